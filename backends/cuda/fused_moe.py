"""The cuda backend's fused_moe on Hopper (kernels/fused_moe_sm90.cu): 16-bit experts at prefill sizes.
Which calls it takes (``supports``), its launch plan, and the launches of one call: the routing in one
CTA, gate-up and down as warp-specialized wgmma grouped GEMMs (B by TMA), and for top-k > 1 the sum. No
launch reads a device value on the host: every size is a bound from host ints (CUDA-graph safe; the weights'
TMA maps travel in the launches' parameters)."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import fused_moe as spec

__all__ = ["CAPABILITY", "MIN_PAIRS_PER_EXPERT", "MoePlan", "describe", "fused_moe", "kernel_names",
           "override_plan", "shared_bytes", "source", "supports"]

CAPABILITY = HOPPER  # wgmma and setmaxnreg: sm_90a cubins run on sm_90 only
ROWS = 128  # rows per routing block: the GEMMs' M (two consumer warpgroups of 64)
COLUMNS = 128  # columns per accumulator; gate-up's CTA covers 128 of gate and of up, down's 256 of H
THREADS = 384  # a producer warpgroup and two consumers
ROUTE_THREADS = 1024  # the routing CTA: one local expert a thread
MAX_EXPERTS = ROUTE_THREADS
SUM_COLUMNS = 256 * 8  # moe_sum_sm90: 256 threads of 8 columns
VECTOR = 8  # elements per 16-byte copy: H and I must be multiples
STAGES = (2, 4)  # pipeline stages the GEMM is instantiated for (4 x 48 KiB fills 193 of the 227 KiB)
B_BOX = (64, 128, 1)  # a B tile's TMA box, innermost first: 64 of K (128 bytes), 128 rows, one expert
# Below this many pairs per expert (at the top of the call's T class) most of a 128-row block is padding
# and the grid leaves SMs idle: the triton backend's 16-64-row blocks serve those calls.
MIN_PAIRS_PER_EXPERT = 64
SOURCE_NAME = "fused_moe_sm90.cu"

_capability = probes.device_capability
_sm_count = probes.compute_units


def shared_bytes(stages: int) -> int:
    """shared_bytes<STAGES>() in the .cu file: per stage the A tile and two B tiles (128 rows x 128
    bytes each), and 1024 bytes of room to align the base (the kernel traps when launched with less)."""
    return stages * 3 * 128 * 128 + 1024


@dataclass(frozen=True)
class MoePlan:
    """A launch's choices: pipeline stages in shared memory (one of STAGES), and whether the GEMMs run a
    CTA per SM that walks the tiles (``persistent``: a tile's loads start under the tile before's
    epilogue) instead of a CTA per tile."""

    stages: int = 4
    persistent: bool = False


DEFAULT_PLAN = MoePlan()


def _plan_problem(plan: MoePlan) -> Optional[str]:
    if plan.stages not in STAGES:
        return f"stages must be one of {STAGES}, got {plan.stages!r}"
    if type(plan.persistent) is not bool:
        return f"persistent must be a bool, got {plan.persistent!r}"
    return None


_plans = PlanSetting("override_plan", DEFAULT_PLAN, _plan_problem)
override_plan = _plans.override_fields


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not."""
    if key.quantization != "none":
        return f"{key.quantization} experts: 16-bit experts only (the triton backend serves quantized ones)"
    if key.apply_router_weight_on_input:
        return ("apply_router_weight_on_input: the GEMM copies input rows as they are into shared memory "
                "(the triton backend scales them)")
    if platform.capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper: the GEMMs are built on its wgmma), "
                f"this GPU is {platform.arch}")
    if key.num_experts > MAX_EXPERTS:
        return f"E = {key.num_experts} local experts > {MAX_EXPERTS}: the routing CTA holds one a thread"
    for name, size in (("H", key.hidden_size), ("I", key.intermediate_size)):
        if size % VECTOR:
            return f"{name} = {size}: a multiple of {VECTOR} only (the kernels copy 16-byte chunks of rows)"
    for name in ("hidden", "w1", "w2"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along its last dim and 16-byte aligned data and strides "
                    f"(the kernels' 16-byte copies), got {tensor_layout}")
    pairs_per_expert = key.num_tokens_class * key.topk / key.num_global_experts
    if pairs_per_expert < MIN_PAIRS_PER_EXPERT:
        return (f"up to {pairs_per_expert:g} pairs per expert (T class {key.num_tokens_class}) < "
                f"{MIN_PAIRS_PER_EXPERT}: its 128-row blocks would be mostly padding (the triton backend's "
                "smaller blocks serve decode sizes)")
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain): the GEMMs' tiles and the plan in force."""
    plan = _plans.current
    grid = "one CTA an SM walking the tiles" if plan.persistent else "a CTA a tile"
    return (f"GEMMs of {ROWS}-row blocks x 2 x {COLUMNS} columns, {plan.stages} stages of 48 KiB, {grid} "
            "(perf/decisions/fused_moe.md)")


def kernel_names(bf16: bool, gelu: bool, stages: int) -> dict[str, str]:
    """The C++ names of one call's kernels for a hidden dtype, an activation and the GEMMs' stages."""
    dtype, act = str(bf16).lower(), str(gelu).lower()
    return {"route": "moe_route_sm90", "gate_up": f"moe_gemm_sm90<{dtype}, true, {act}, {stages}>",
            "down": f"moe_gemm_sm90<{dtype}, false, false, {stages}>", "sum": f"moe_sum_sm90<{dtype}>"}


def source(names: dict[str, str]) -> str:
    """kernels/fused_moe_sm90.cu with the named ABI's checks for ``names`` (kernel_names')."""
    return _params.checked_source(SOURCE_NAME, [
        (_params.MoeRouteParams, [names["route"]]),
        (_params.MoeGemmParams, [names["gate_up"], names["down"]]),
        (_params.MoeSumParams, [names["sum"]]),
    ])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], bf16: bool, gelu: bool,
              stages: int) -> tuple[_compile.CompiledModule, dict[str, str]]:
    """One NVRTC compilation per arch, macro set and template set: (module, kernel names)."""
    names = kernel_names(bf16, gelu, stages)
    module = _compile.compile_module_cached(source(names), list(names.values()), arch, filename=SOURCE_NAME,
                                            arch_specific=True, defines=defines)
    return module, names


_LOADED = _driver.LoadedKernels()


def _kernels(device: torch.device, bf16: bool, gelu: bool, stages: int) -> tuple[_driver.Kernel, ...]:
    """(route, gate-up, down, sum), loaded on ``device`` (cached per device, diagnostics and templates)."""
    defines = _compile.diagnostics_in_force()

    def build():
        module, names = _compiled(_capability(device), defines, bf16, gelu, stages)
        gemm_bytes = shared_bytes(stages)
        return module, [_driver.KernelSpec(names["route"], _params.MoeRouteParams, ROUTE_THREADS),
                        _driver.KernelSpec(names["gate_up"], _params.MoeGemmParams, THREADS, gemm_bytes),
                        _driver.KernelSpec(names["down"], _params.MoeGemmParams, THREADS, gemm_bytes),
                        _driver.KernelSpec(names["sum"], _params.MoeSumParams, SUM_COLUMNS // VECTOR)]

    return _LOADED.get(device, (defines, bf16, gelu, stages), build)


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    quantization: str = "none",
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's fused_moe for 16-bit experts: routing, gate-up with the activation, down with the
    router weight (top-1: into the output), and for top-k > 1 the sum of each token's pair rows in
    fp32, rounded once. Arguments are validated by the caller and accepted by ``supports``."""
    num_tokens, hidden_size = hidden.shape
    dtype, device = hidden.dtype, hidden.device
    if num_tokens == 0:
        return hidden.new_empty((0, hidden_size))
    experts, inter_size = w1.shape[0], w1.shape[1] // 2
    topk = topk_ids.shape[1]
    pairs = num_tokens * topk
    # Each used expert's run pads to whole blocks: at most min(E, pairs) runs of < ROWS padding.
    max_rows = -(-(pairs + min(experts, pairs) * (ROWS - 1)) // ROWS) * ROWS
    max_blocks = max_rows // ROWS
    index = torch.empty(2 * experts + max_blocks + max_rows, dtype=torch.int32, device=device)
    counts, starts = index[:experts], index[experts:2 * experts]
    block_expert = index[2 * experts:2 * experts + max_blocks]
    sorted_pairs = index[2 * experts + max_blocks:]
    inter = torch.empty((max_rows, inter_size), dtype=dtype, device=device)
    has_map = expert_map is not None
    if topk > 1:
        down_out = torch.empty((pairs, hidden_size), dtype=dtype, device=device)
    elif has_map:  # top-1: a token whose one expert is on another rank gets zeros
        down_out = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    else:
        down_out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    routing = dict(topk_ids=topk_ids, expert_map=expert_map, ids_stride_t=topk_ids.stride(0),
                   ids_stride_k=topk_ids.stride(1), map_stride=expert_map.stride(0) if has_map else 0)
    layout = dict(sorted_pairs=sorted_pairs, block_expert=block_expert, starts=starts, counts=counts,
                  topk_weights=topk_weights, topk=topk, max_blocks=max_blocks,
                  weights_stride_t=topk_weights.stride(0), weights_stride_k=topk_weights.stride(1))
    plan = _plans.current

    def grid(column_tiles: int) -> tuple[int, int, int]:  # a CTA a tile, or one a multiprocessor walking them
        tiles = max_blocks * column_tiles
        return (min(tiles, _sm_count(device)) if plan.persistent else tiles, 1, 1)

    with torch.cuda.device(device):
        route, gate_up, down, moe_sum = _kernels(device, dtype == torch.bfloat16, activation == "gelu", plan.stages)
        route((1, 1, 1), counts=counts, starts=starts, block_expert=block_expert, sorted_pairs=sorted_pairs,
              num_pairs=pairs, topk=topk, num_experts=experts, max_blocks=max_blocks, **routing)
        gate_up(grid(-(-inter_size // COLUMNS)), b_map=_driver.tensor_map(w1, B_BOX), a=hidden, out=inter,
                n_size=inter_size, k_size=hidden_size, a_stride=hidden.stride(0), out_stride=inter.stride(0),
                **layout)
        down(grid(-(-hidden_size // (2 * COLUMNS))), b_map=_driver.tensor_map(w2, B_BOX), a=inter, out=down_out,
             n_size=hidden_size, k_size=inter_size, a_stride=inter.stride(0), out_stride=down_out.stride(0),
             **layout)
        if topk == 1:
            return down_out
        out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
        moe_sum((num_tokens, -(-hidden_size // SUM_COLUMNS), 1), pairs=down_out, out=out, hidden_size=hidden_size,
                topk=topk, pairs_stride=down_out.stride(0), out_stride=out.stride(0), **routing)
    return out
