"""The cuda backend's fused_moe on Hopper: 16-bit and 128-block fp8 (DeepSeek-V3) experts at prefill sizes
(kernels/fused_moe_sm90.cu), and 16-bit and fp4 (MXFP4, NVFP4: W4A16) experts at T = 1
(kernels/fused_moe_decode.cu). Which calls it takes (``supports``), its launch plan, and the launches of one call:
at prefill sizes the routing in one CTA, gate-up and down as warp-specialized wgmma grouped GEMMs (B by TMA; fp8:
the input quantized 1 x 128 first by the cuda quantize_fp8, the intermediate by gate-up's epilogue), and for
top-k > 1 the sum; at T = 1 two GEMVs (no routing, down sums the top-k itself), for fp4 experts on the tensor cores
with the weights decoded in registers. No launch reads a device value on the host: every size is a bound from host
ints (CUDA-graph safe; the weights' TMA maps travel in the launches' parameters)."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda import quantize_fp8 as cuda_quantize_fp8
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import fused_moe as spec

__all__ = ["CAPABILITY", "DECODE_MAX_TOKENS", "MIN_PAIRS_PER_EXPERT", "MoePlan", "decode_kernel_names",
           "decode_source", "describe", "fused_moe", "kernel_names", "override_plan", "shared_bytes", "source",
           "supports"]

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
FP8_B_BOX = (128, 128, 1)  # fp8 experts: 128 of K (128 bytes, one scale block)
FP8_BLOCK = 128  # fp8_block's weight blocks and activation groups: H and I must be multiples (a K step, a tile)
# Below this many pairs per expert (at the top of the call's T class) most of a 128-row block is padding
# and the grid leaves SMs idle: the triton backend's 16-64-row blocks serve those calls.
MIN_PAIRS_PER_EXPERT = 64
SOURCE_NAME = "fused_moe_sm90.cu"
# The decode GEMVs: at T = 1 each pair has its own expert, whose weights one pass streams.
DECODE_MAX_TOKENS = 1
# Above this many bytes of routed weights a T = 1 call stays with triton's grouped kernels, which stream
# large experts faster: H200, Qwen3-30B-A3B's 75 MB 24.2 us against triton's 30.1, Mixtral's 705 MB 178.0
# against 176.4 (perf/decisions/fused_moe.md).
DECODE_MAX_ROUTED_BYTES = 256 << 20
GEMV_THREADS = 256
MAX_DECODE_TOPK = 32  # down keeps slot s's expert and router weight in lane s of a warp
DECODE_SOURCE_NAME = "fused_moe_decode.cu"
# fp4 experts: what the GEMVs decode (the GEMMs take 16-bit experts only), a CTA per tile of outputs whose
# warps split K (the .cu file's kFp4*Warps), and K a multiple of FP4_ROW_CODES (a lane loads 16 bytes of codes).
FP4_QUANTIZATIONS = ("mxfp4", "nvfp4")
FP4_GATE_UP_THREADS = 4 * 32  # a CTA: 8 columns of gate and of up
FP4_DOWN_THREADS = 8 * 32  # a CTA: 16 columns of H
FP4_GATE_UP_COLUMNS, FP4_DOWN_COLUMNS = 8, 16
FP4_ROW_CODES = 32

_capability = probes.device_capability
_sm_count = probes.compute_units


def shared_bytes(stages: int) -> int:
    """shared_bytes<STAGES>() in the .cu file: per stage the A tile and two B tiles (128 rows x 128
    bytes each), and 1024 bytes of room to align the base (the kernel traps when launched with less)."""
    return stages * 3 * 128 * 128 + 1024


@dataclass(frozen=True)
class MoePlan:
    """A launch's choices: pipeline stages in shared memory (one of STAGES), whether the GEMMs run a
    CTA per SM that walks the tiles (``persistent``: a tile's loads start under the tile before's
    epilogue) instead of a CTA per tile, and whether the decode GEMVs serve the call (``gemv``; None:
    at T <= DECODE_MAX_TOKENS; True or False at any T, for tests and sweeps)."""

    stages: int = 4
    persistent: bool = False
    gemv: Optional[bool] = None


DEFAULT_PLAN = MoePlan()


def _plan_problem(plan: MoePlan) -> Optional[str]:
    if plan.stages not in STAGES:
        return f"stages must be one of {STAGES}, got {plan.stages!r}"
    if type(plan.persistent) is not bool:
        return f"persistent must be a bool, got {plan.persistent!r}"
    if plan.gemv is not None and type(plan.gemv) is not bool:
        return f"gemv must be None or a bool, got {plan.gemv!r}"
    return None


_plans = PlanSetting("override_plan", DEFAULT_PLAN, _plan_problem)
override_plan = _plans.override_fields


def _by_gemvs(plan: MoePlan, num_tokens: int) -> bool:
    """Whether the decode GEMVs serve a call of ``num_tokens`` (or its class) under ``plan``."""
    return plan.gemv if plan.gemv is not None else num_tokens <= DECODE_MAX_TOKENS


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not."""
    fp4 = key.quantization in FP4_QUANTIZATIONS
    if key.quantization not in ("none", "fp8_block") and not fp4:
        return (f"{key.quantization} experts: 16-bit, fp8_block and fp4 experts only (the triton backend serves "
                f"{key.quantization} ones)")
    decode = key.num_tokens_class <= DECODE_MAX_TOKENS
    if key.quantization == "fp8_block":
        problem = _fp8_problem(key.weight_dtype, key.hidden_size, key.intermediate_size)
        if problem:
            return problem
        if decode:
            return (f"fp8_block experts at T = {DECODE_MAX_TOKENS}: the decode GEMVs take 16-bit and fp4 experts "
                    "(the triton backend serves these)")
    if fp4 and not decode:
        return (f"{key.quantization} experts above T = {DECODE_MAX_TOKENS}: only the decode GEMVs decode fp4 "
                "weights here (the triton backend serves larger T)")
    if fp4:
        problem = _fp4_problem(key.quantization, key.hidden_dtype, key.hidden_size, key.intermediate_size)
        if problem:
            return problem
    if key.apply_router_weight_on_input and not decode:
        return ("apply_router_weight_on_input above T = 1: the GEMM copies input rows as they are into shared "
                "memory (the triton backend scales them)")
    if platform.capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper: the GEMMs are built on its wgmma, and the "
                f"decode GEMVs were measured there), this GPU is {platform.arch}")
    if decode and key.topk > MAX_DECODE_TOPK:
        return f"top-k = {key.topk} > {MAX_DECODE_TOPK}: the down GEMV holds a slot a lane of a warp"
    if decode:
        weight_bytes = 0.5 if fp4 else key.weight_dtype.itemsize
        routed_bytes = key.topk * 3 * key.hidden_size * key.intermediate_size * weight_bytes
        if routed_bytes > DECODE_MAX_ROUTED_BYTES:
            return (f"T = 1 over {routed_bytes / 2**20:.0f} MiB of routed weights > {DECODE_MAX_ROUTED_BYTES >> 20} "
                    "MiB: the triton backend's grouped kernels stream large experts faster than the decode GEMVs")
    if not decode and key.num_experts > MAX_EXPERTS:
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
    if not decode and pairs_per_expert < MIN_PAIRS_PER_EXPERT:
        return (f"up to {pairs_per_expert:g} pairs per expert (T class {key.num_tokens_class}) < "
                f"{MIN_PAIRS_PER_EXPERT}: its 128-row blocks would be mostly padding (the triton backend's "
                "smaller blocks serve decode sizes)")
    return None


def _fp8_problem(weight_dtype: torch.dtype, hidden_size: int, inter_size: int) -> Optional[str]:
    """Why the GEMMs cannot compute a call with these fp8_block experts, or None."""
    if weight_dtype != torch.float8_e4m3fn:
        return f"fp8_block experts in {weight_dtype}: e4m3fn only (the wgmma's e4m3; the triton backend serves others)"
    for name, size in (("H", hidden_size), ("I", inter_size)):
        if size % FP8_BLOCK:
            return (f"{name} = {size}: fp8_block experts need a multiple of {FP8_BLOCK} (a K step is one scale "
                    "block, a gate-up tile one group of the intermediate)")
    return None


def _fp4_problem(quantization: str, hidden_dtype: torch.dtype, hidden_size: int, inter_size: int) -> Optional[str]:
    """Why the fp4 decode GEMVs cannot compute a call with these experts and activations, or None."""
    if quantization == "mxfp4" and hidden_dtype == torch.float16:
        return ("MXFP4 experts with fp16 activations: the tensor cores would take the weights as fp16, whose range "
                "e8m0 scales leave (the triton backend decodes those to fp32)")
    for name, size in (("H", hidden_size), ("I", inter_size)):
        if size % FP4_ROW_CODES:
            return (f"{name} = {size}: fp4 experts need a multiple of {FP4_ROW_CODES} (a lane loads 16 bytes of "
                    "packed codes)")
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain): the decode GEMVs, or the GEMMs' tiles and the plan in force."""
    plan = _plans.current
    if key.quantization in FP4_QUANTIZATIONS:
        return (f"decode GEMVs of {key.quantization} experts on the tensor cores: weights decoded in registers, "
                f"a CTA a tile ({FP4_GATE_UP_COLUMNS} columns of gate and up; {FP4_DOWN_COLUMNS} of H) whose warps "
                "split K (perf/decisions/fused_moe.md)")
    if _by_gemvs(plan, key.num_tokens_class):
        return ("decode GEMVs: gate-up a warp a (pair, column), down a warp a (token, column) summing the top-k, "
                "16-byte weight loads 4-8 deep per lane, every SM's warps loading (perf/decisions/fused_moe.md)")
    grid = "one CTA an SM walking the tiles" if plan.persistent else "a CTA a tile"
    fp8 = (", e4m3 wgmmas promoted per 128-K block, the intermediate quantized in gate-up's epilogue"
           if key.quantization == "fp8_block" else "")
    return (f"GEMMs of {ROWS}-row blocks x 2 x {COLUMNS} columns, {plan.stages} stages of 48 KiB, {grid}{fp8} "
            "(perf/decisions/fused_moe.md)")


def kernel_names(bf16: bool, gelu: bool, stages: int, fp8: bool = False) -> dict[str, str]:
    """The C++ names of one call's kernels for a hidden dtype, an activation, the GEMMs' stages and whether the
    experts are fp8_block."""
    dtype, act, e4m3 = str(bf16).lower(), str(gelu).lower(), str(fp8).lower()
    return {"route": "moe_route_sm90", "gate_up": f"moe_gemm_sm90<{dtype}, true, {act}, {stages}, {e4m3}>",
            "down": f"moe_gemm_sm90<{dtype}, false, false, {stages}, {e4m3}>", "sum": f"moe_sum_sm90<{dtype}>"}


def decode_kernel_names(bf16: bool, gelu: bool, quantization: str = "none") -> dict[str, str]:
    """The C++ names of the decode GEMVs for a hidden dtype, an activation and the experts' quantization
    ("none" or one of FP4_QUANTIZATIONS)."""
    dtype, act = str(bf16).lower(), str(gelu).lower()
    if quantization == "none":
        return {"gate_up": f"moe_decode_gate_up<{dtype}, {act}>", "down": f"moe_decode_down<{dtype}>"}
    nvfp4 = str(quantization == "nvfp4").lower()
    return {"gate_up": f"moe_decode_fp4_gate_up<{dtype}, {act}, {nvfp4}>",
            "down": f"moe_decode_fp4_down<{dtype}, {nvfp4}>"}


def _decode_params(quantization: str) -> tuple[type, type]:
    """The (gate-up, down) params mirrors of the decode GEMVs for the experts' quantization."""
    if quantization == "none":
        return _params.MoeDecodeGateUpParams, _params.MoeDecodeDownParams
    return _params.MoeDecodeFp4GateUpParams, _params.MoeDecodeFp4DownParams


def decode_source(names: dict[str, str], quantization: str = "none") -> str:
    """kernels/fused_moe_decode.cu with the named ABI's checks for ``names`` (decode_kernel_names')."""
    gate_up, down = _decode_params(quantization)
    return _params.checked_source(DECODE_SOURCE_NAME, [(gate_up, [names["gate_up"]]), (down, [names["down"]])])


def source(names: dict[str, str]) -> str:
    """kernels/fused_moe_sm90.cu with the named ABI's checks for ``names`` (kernel_names')."""
    return _params.checked_source(SOURCE_NAME, [
        (_params.MoeRouteParams, [names["route"]]),
        (_params.MoeGemmParams, [names["gate_up"], names["down"]]),
        (_params.MoeSumParams, [names["sum"]]),
    ])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], bf16: bool, gelu: bool, stages: int,
              fp8: bool) -> tuple[_compile.CompiledModule, dict[str, str]]:
    """One NVRTC compilation per arch, macro set and template set: (module, kernel names)."""
    names = kernel_names(bf16, gelu, stages, fp8)
    module = _compile.compile_module_cached(source(names), list(names.values()), arch, filename=SOURCE_NAME,
                                            arch_specific=True, defines=defines)
    return module, names


@functools.cache
def _compiled_decode(arch: tuple[int, int], defines: tuple[str, ...], bf16: bool, gelu: bool,
                     quantization: str) -> tuple[_compile.CompiledModule, dict[str, str]]:
    names = decode_kernel_names(bf16, gelu, quantization)
    module = _compile.compile_module_cached(decode_source(names, quantization), list(names.values()), arch,
                                            filename=DECODE_SOURCE_NAME, defines=defines)
    return module, names


_LOADED = _driver.LoadedKernels()
_LOADED_DECODE = _driver.LoadedKernels()


def _kernels(device: torch.device, bf16: bool, gelu: bool, stages: int, fp8: bool) -> tuple[_driver.Kernel, ...]:
    """(route, gate-up, down, sum), loaded on ``device`` (cached per device, diagnostics and templates)."""
    defines = _compile.diagnostics_in_force()

    def build():
        module, names = _compiled(_capability(device), defines, bf16, gelu, stages, fp8)
        gemm_bytes = shared_bytes(stages)
        return module, [_driver.KernelSpec(names["route"], _params.MoeRouteParams, ROUTE_THREADS),
                        _driver.KernelSpec(names["gate_up"], _params.MoeGemmParams, THREADS, gemm_bytes),
                        _driver.KernelSpec(names["down"], _params.MoeGemmParams, THREADS, gemm_bytes),
                        _driver.KernelSpec(names["sum"], _params.MoeSumParams, SUM_COLUMNS // VECTOR)]

    return _LOADED.get(device, (defines, bf16, gelu, stages, fp8), build)


def _decode_kernels(device: torch.device, bf16: bool, gelu: bool,
                    quantization: str = "none") -> tuple[_driver.Kernel, ...]:
    """(gate-up, down) GEMVs for the experts' quantization, loaded on ``device``."""
    defines = _compile.diagnostics_in_force()
    gate_up, down = _decode_params(quantization)
    threads = (GEMV_THREADS, GEMV_THREADS) if quantization == "none" else (FP4_GATE_UP_THREADS, FP4_DOWN_THREADS)

    def build():
        module, names = _compiled_decode(_capability(device), defines, bf16, gelu, quantization)
        return module, [_driver.KernelSpec(names["gate_up"], gate_up, threads[0]),
                        _driver.KernelSpec(names["down"], down, threads[1])]

    return _LOADED_DECODE.get(device, (defines, bf16, gelu, quantization), build)


def _gemv_grid(kernel: _driver.Kernel, device: torch.device, tasks: int) -> tuple[int, int, int]:
    """CTAs for ``tasks`` warp tasks: each warp takes as many tasks as the GPU's resident warps need to cover
    them all in one pass, and the grid is as small as gives every warp that many (the last fewer), so no
    warp runs a task more than the others while they idle."""
    warps = GEMV_THREADS // 32
    per_warp = -(-tasks // (kernel.blocks_per_sm * _sm_count(device) * warps))
    return (max(1, -(-tasks // (per_warp * warps))), 1, 1)


def _routing_fields(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> dict:
    """The params fields every kernel that reads the routing takes (local_expert's arguments)."""
    return dict(topk_ids=topk_ids, expert_map=expert_map, ids_stride_t=topk_ids.stride(0),
                ids_stride_k=topk_ids.stride(1), map_stride=expert_map.stride(0) if expert_map is not None else 0)


def _decode_call(hidden, w1, topk_weights, topk_ids, expert_map,
                 apply_router_weight_on_input) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """What both kinds of decode GEMVs start from: the [T * k, I] intermediate, the output, and the params fields
    of the routing both launches read."""
    num_tokens, hidden_size = hidden.shape
    inter_size, topk = w1.shape[1] // 2, topk_ids.shape[1]
    if topk > MAX_DECODE_TOPK:  # supports declines these at T = 1; a plan may force the GEMVs at any T
        raise ValueError(f"topk_ids: the decode GEMVs take top-k <= {MAX_DECODE_TOPK}, got {topk}")
    inter = torch.empty((num_tokens * topk, inter_size), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    routing = dict(_routing_fields(topk_ids, expert_map), topk_weights=topk_weights, topk=topk,
                   on_input=int(apply_router_weight_on_input), weights_stride_t=topk_weights.stride(0))
    return inter, out, routing


def _fused_moe_decode(hidden, w1, w2, topk_weights, topk_ids, activation, expert_map,
                      apply_router_weight_on_input) -> torch.Tensor:
    """The decode GEMVs: gate-up into a [T * k, I] intermediate, then down summing each token's slots."""
    num_tokens, hidden_size = hidden.shape
    inter_size, topk = w1.shape[1] // 2, topk_ids.shape[1]
    inter, out, routing = _decode_call(hidden, w1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input)
    device = hidden.device
    with torch.cuda.device(device):
        gate_up, down = _decode_kernels(device, hidden.dtype == torch.bfloat16, activation == "gelu")
        gate_up(_gemv_grid(gate_up, device, num_tokens * topk * inter_size), overlap_previous=True,
                hidden=hidden, w1=w1, inter=inter, num_pairs=num_tokens * topk, inter_size=inter_size,
                hidden_size=hidden_size, hidden_stride=hidden.stride(0), w1_stride_e=w1.stride(0),
                w1_stride_n=w1.stride(1), inter_stride=inter.stride(0), **routing)
        down(_gemv_grid(down, device, num_tokens * hidden_size), overlap_previous=True,
             inter=inter, w2=w2, out=out, num_tokens=num_tokens, hidden_size=hidden_size, inter_size=inter_size,
             inter_stride=inter.stride(0), w2_stride_e=w2.stride(0), w2_stride_n=w2.stride(1),
             out_stride=out.stride(0), weights_stride_k=topk_weights.stride(1), **routing)
    return out


def _fused_moe_decode_fp4(hidden, w1, w2, topk_weights, topk_ids, activation, expert_map,
                          apply_router_weight_on_input, quantization, w1_scale, w2_scale, w1_global_scale,
                          w2_global_scale) -> torch.Tensor:
    """The decode GEMVs of fp4 experts: a CTA per 8 columns of a pair's gate-up, then one per 16 columns of a
    token's output."""
    num_tokens, hidden_size = hidden.shape
    inter_size, topk = w1.shape[1] // 2, topk_ids.shape[1]
    problem = _fp4_problem(quantization, hidden.dtype, hidden_size, inter_size)  # supports declines these
    if problem:
        raise ValueError(f"w1: {problem}")
    inter, out, routing = _decode_call(hidden, w1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input)
    device = hidden.device
    if quantization == "nvfp4":  # the kernels read e4m3 codes as bytes
        w1_scale, w2_scale = w1_scale.view(torch.uint8), w2_scale.view(torch.uint8)

    def scales(scale, global_scale):  # a weight's scale fields; MXFP4 has no global scale (a null pointer)
        return dict(scale_stride_e=scale.stride(0), scale_stride_n=scale.stride(1), scale_stride_k=scale.stride(2),
                    global_stride=global_scale.stride(0) if global_scale is not None else 0)

    with torch.cuda.device(device):
        gate_up, down = _decode_kernels(device, hidden.dtype == torch.bfloat16, activation == "gelu", quantization)
        gate_up((num_tokens * topk * (inter_size // FP4_GATE_UP_COLUMNS), 1, 1), overlap_previous=True,
                hidden=hidden, w1=w1, w1_scale=w1_scale, w1_global=w1_global_scale, inter=inter,
                num_pairs=num_tokens * topk, inter_size=inter_size, hidden_size=hidden_size,
                hidden_stride=hidden.stride(0), w1_stride_e=w1.stride(0), w1_stride_n=w1.stride(1),
                inter_stride=inter.stride(0), **scales(w1_scale, w1_global_scale), **routing)
        down((num_tokens * (hidden_size // FP4_DOWN_COLUMNS), 1, 1), overlap_previous=True,
             inter=inter, w2=w2, w2_scale=w2_scale, w2_global=w2_global_scale, out=out, num_tokens=num_tokens,
             hidden_size=hidden_size, inter_size=inter_size, inter_stride=inter.stride(0),
             w2_stride_e=w2.stride(0), w2_stride_n=w2.stride(1), out_stride=out.stride(0),
             weights_stride_k=topk_weights.stride(1), **scales(w2_scale, w2_global_scale), **routing)
    return out


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
    """The spec's fused_moe for 16-bit and fp8_block experts: routing, gate-up with the activation, down with
    the router weight (top-1: into the output), and for top-k > 1 the sum of each token's pair rows in fp32,
    rounded once; at T <= DECODE_MAX_TOKENS (or as the plan says) the decode GEMVs instead for 16-bit experts,
    the only route for fp4 experts. Arguments are validated by the caller and accepted by ``supports``."""
    num_tokens, hidden_size = hidden.shape
    dtype, device = hidden.dtype, hidden.device
    if num_tokens == 0:
        return hidden.new_empty((0, hidden_size))
    plan = _plans.current
    if quantization in FP4_QUANTIZATIONS:
        if plan.gemv is False:  # supports declines fp4 above T = 1; a plan may force the GEMMs at any T
            raise ValueError(f"quantization: {quantization} experts run the decode GEMVs only, and the plan "
                             "forces the GEMMs")
        return _fused_moe_decode_fp4(hidden, w1, w2, topk_weights, topk_ids, activation, expert_map,
                                     apply_router_weight_on_input, quantization, w1_scale, w2_scale,
                                     w1_global_scale, w2_global_scale)
    fp8 = quantization == "fp8_block"
    if fp8:  # supports declines these; a direct call is refused before anything launches
        problem = _fp8_problem(w1.dtype, hidden_size, w1.shape[1] // 2)
        if problem:
            raise ValueError(f"w1: {problem}")
        if plan.gemv:
            raise ValueError("quantization: fp8_block experts run the GEMMs only, and the plan forces the decode GEMVs")
    elif quantization != "none":
        raise ValueError(f"quantization: 16-bit, fp8_block or fp4 experts, got {quantization}")
    elif _by_gemvs(plan, num_tokens):
        return _fused_moe_decode(hidden, w1, w2, topk_weights, topk_ids, activation, expert_map,
                                 apply_router_weight_on_input)
    if apply_router_weight_on_input:  # supports declines it above T = 1; a plan may force the GEMMs at T = 1
        raise ValueError("apply_router_weight_on_input: the GEMMs copy input rows as they are (the decode GEMVs "
                         "scale them)")
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
    inter = torch.empty((max_rows, inter_size), dtype=torch.uint8 if fp8 else dtype, device=device)
    has_map = expert_map is not None
    if topk > 1:
        down_out = torch.empty((pairs, hidden_size), dtype=dtype, device=device)
    elif has_map:  # top-1: a token whose one expert is on another rank gets zeros
        down_out = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    else:
        down_out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    routing = _routing_fields(topk_ids, expert_map)
    layout = dict(sorted_pairs=sorted_pairs, block_expert=block_expert, starts=starts, counts=counts,
                  topk_weights=topk_weights, topk=topk, max_blocks=max_blocks,
                  weights_stride_t=topk_weights.stride(0), weights_stride_k=topk_weights.stride(1))

    def grid(column_tiles: int) -> tuple[int, int, int]:  # a CTA a tile, or one a multiprocessor walking them
        tiles = max_blocks * column_tiles
        return (min(tiles, _sm_count(device)) if plan.persistent else tiles, 1, 1)

    def scales(a_scale, b_scale, out_scale=None) -> dict:  # the fp8 GEMMs' scale fields (16-bit: nulls)
        if a_scale is None:
            return dict(a_scale=None, b_scale=None, out_scale=None, a_scale_stride=0, b_scale_stride_e=0,
                        b_scale_stride_n=0, b_scale_stride_k=0, out_scale_stride=0)
        return dict(a_scale=a_scale, b_scale=b_scale, out_scale=out_scale, a_scale_stride=a_scale.stride(0),
                    b_scale_stride_e=b_scale.stride(0), b_scale_stride_n=b_scale.stride(1),
                    b_scale_stride_k=b_scale.stride(2),
                    out_scale_stride=0 if out_scale is None else out_scale.stride(0))

    with torch.cuda.device(device):
        if fp8:  # the input in 1 x 128 groups, contiguous scales [T, H / 128] (the kernel steps them by one)
            gate_up_a, hidden_scale = cuda_quantize_fp8.quantize_fp8(hidden, "per_group", FP8_BLOCK, False,
                                                                     "e4m3fn")
            inter_scale = torch.empty((max_rows, inter_size // FP8_BLOCK), dtype=torch.float32, device=device)
            gate_up_scales = scales(hidden_scale, w1_scale, inter_scale)
            down_scales = scales(inter_scale, w2_scale)
        else:
            gate_up_a, gate_up_scales = hidden, scales(None, None)
            down_scales = gate_up_scales
        box = FP8_B_BOX if fp8 else B_BOX
        route, gate_up, down, moe_sum = _kernels(device, dtype == torch.bfloat16, activation == "gelu", plan.stages,
                                                 fp8)
        route((1, 1, 1), counts=counts, starts=starts, block_expert=block_expert, sorted_pairs=sorted_pairs,
              num_pairs=pairs, topk=topk, num_experts=experts, max_blocks=max_blocks, **routing)
        gate_up(grid(-(-inter_size // COLUMNS)), b_map=_driver.tensor_map(w1, box), a=gate_up_a, out=inter,
                n_size=inter_size, k_size=hidden_size, a_stride=gate_up_a.stride(0), out_stride=inter.stride(0),
                **gate_up_scales, **layout)
        down(grid(-(-hidden_size // (2 * COLUMNS))), b_map=_driver.tensor_map(w2, box), a=inter, out=down_out,
             n_size=hidden_size, k_size=inter_size, a_stride=inter.stride(0), out_stride=down_out.stride(0),
             **down_scales, **layout)
        if topk == 1:
            return down_out
        out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
        moe_sum((num_tokens, -(-hidden_size // SUM_COLUMNS), 1), pairs=down_out, out=out, hidden_size=hidden_size,
                topk=topk, pairs_stride=down_out.stride(0), out_stride=out.stride(0), **routing)
    return out
