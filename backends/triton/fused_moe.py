"""The triton backend's fused_moe: which calls its kernels take, their launch configuration (a
heuristic by pairs per expert, with an override for sweeps and tests) and the launches of one call:
routing layout (count, lay out, scatter), gate-up GEMM with the activation fused, down GEMM with the
router weight and the top-k sum fused (kernels: _fused_moe_kernel.py, imported on the first launch
so the backend registers without Triton). No launch reads a device value on the host: every size is
a bound from host ints, and programs past the routed rows return at once."""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import INTERPRETED, device_guard, native_fp8_cast, next_pow2
from kernelmux.platforms import Platform, PlatformKind, probes
from kernelmux.specs import fused_moe as spec

__all__ = ["GemmConfig", "LaunchConfig", "MAX_EXPERTS", "describe", "fused_moe", "launch_config",
           "override_launch_config", "supports"]

# The layout kernel holds every local expert's count in one program's registers.
MAX_EXPERTS = 1024
FP8_MAX = 448.0  # e4m3fn
QUANT_MODES = {"none": 0, "fp8_per_tensor": 1, "fp8_block": 2}  # _fused_moe_kernel's QUANT
PAIRS_PER_PROGRAM = 256  # the count and scatter kernels: one pair per lane
FP8_DOT_CAPABILITY = (8, 9)  # tl.dot on e4m3 operands: Ada and Hopper tensor cores
FP8_DOT_MIN_K = 32  # tl.dot on e4m3 operands needs K >= 32 (Triton 3.6 on the H200)


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tiles: columns and reduction per step, row blocks sharing a column tile
    in L2 (GROUP_M), warps and software-pipeline stages."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class LaunchConfig:
    """Rows per block of the routing layout (both GEMMs' BLOCK_M), and each GEMM's tiles."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    tuned: bool = False  # from a measured table (perf/decisions/fused_moe.md), else the heuristic


def _heuristic(pairs_per_expert: float, block_k: int) -> LaunchConfig:
    """A cheap default for devices with no table: the row block follows the tokens an expert gets
    (decode: 16-row blocks, so each touched expert's weights are read once and few rows are padding);
    wide column tiles once there are rows enough to reuse them."""
    if pairs_per_expert <= 16:
        tiles = GemmConfig(block_n=64, block_k=block_k, group_m=1, num_warps=4, num_stages=4)
        return LaunchConfig(16, tiles, tiles)
    if pairs_per_expert <= 64:
        tiles = GemmConfig(block_n=64, block_k=block_k, group_m=4, num_warps=4, num_stages=4)
        return LaunchConfig(32, tiles, tiles)
    tiles = GemmConfig(block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)
    return LaunchConfig(64, tiles, tiles)


def _measured(block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int) -> LaunchConfig:
    tiles = GemmConfig(block_n, block_k, group_m, num_warps, num_stages)
    return LaunchConfig(block_m, tiles, tiles, tuned=True)


# Measured launch configurations: device name -> (quantization, bucket of pairs per expert
# (lo, hi], configuration); a call in no row takes the heuristic. Each row is the fastest of the sweep
# of perf/diag/fused_moe_goals.py --sweep on that bucket's goal shapes (perf/decisions/fused_moe.md).
_TABLES: dict[str, tuple[tuple[str, float, float, LaunchConfig], ...]] = {
    "NVIDIA H200": (
        # Mixtral T 1 and 64, Qwen3 T 1 and 64 (0.06-16 pairs per expert): 181, 859, 33.9, 294 us.
        ("none", 0, 16, _measured(16, 64, 128, 1, 4, 4)),
        # Qwen3 T 4096 (256 per expert): 1155 us; BM 64 x BN 128 1162, BM 128 x BN 128 1299.
        ("none", 128, 512, _measured(128, 64, 64, 8, 8, 3)),
        # Mixtral T 4096 (1024 per expert): 6063 us; BN 64 6652, the heuristic's BM 64 7598.
        ("none", 512, float("inf"), _measured(128, 128, 64, 8, 8, 3)),
        # DeepSeek-V3 T 1 (0.03 per expert): 257 us; 4 warps 362. T 64 (2 per expert): 5507 us; 8 warps 5934.
        ("fp8_block", 0, 1, _measured(16, 128, 128, 1, 8, 3)),
        ("fp8_block", 1, 16, _measured(16, 128, 128, 1, 4, 3)),
    ),
}


def _config_problem(config: Optional[LaunchConfig]) -> Optional[str]:
    if config is None:
        return None
    if config.block_m < 16 or config.block_m & (config.block_m - 1):
        return f"block_m = {config.block_m}: tl.dot needs a power of two >= 16"
    for gemm in (config.gate_up, config.down):
        for value in (gemm.block_n, gemm.block_k):
            if value < 16 or value & (value - 1):
                return f"{gemm}: tl.dot needs tiles that are powers of two >= 16"
    return None


# The launch configuration in force instead of the table's or the heuristic's (None: theirs).
_override: ScopedSetting[Optional[LaunchConfig]] = ScopedSetting("override_launch_config", None, _config_problem)


def override_launch_config(config: LaunchConfig) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Use ``config`` for every call inside the block (sweeps, tests); restores the previous one.
    fp8 calls keep at least 32 as block_k (tl.dot on e4m3), fp8_block exactly 128 (one activation
    group per step)."""
    return _override.override(config)


def launch_config(num_pairs: int, num_experts: int, quantization: str, device_name: str = "") -> LaunchConfig:
    """The launch configuration for a call of ``num_pairs`` (token, slot) pairs routed over
    ``num_experts`` (global: a rank's experts get their share): the active override, else the
    device's measured row for its bucket of pairs per expert, else the heuristic."""
    pairs_per_expert = num_pairs / num_experts
    config = _override.current
    if config is None:
        config = next((row for kind, lo, hi, row in _TABLES.get(device_name, ())
                       if kind == quantization and lo < pairs_per_expert <= hi), None)
    if config is None:
        config = _heuristic(pairs_per_expert, 128 if quantization == "fp8_block" else 64)
    if quantization != "none":
        least, most = (spec.BLOCK, spec.BLOCK) if quantization == "fp8_block" else (FP8_DOT_MIN_K, None)
        config = LaunchConfig(config.block_m, _clamp_k(config.gate_up, least, most),
                              _clamp_k(config.down, least, most), config.tuned)
    return config


def _clamp_k(gemm: GemmConfig, least: int, most: Optional[int]) -> GemmConfig:
    block_k = max(gemm.block_k, least) if most is None else min(max(gemm.block_k, least), most)
    return GemmConfig(gemm.block_n, block_k, gemm.group_m, gemm.num_warps, gemm.num_stages)


@functools.cache
def _device_name(device: torch.device) -> str:
    """The name the tables are keyed by ("" under the interpreter and off CUDA: the heuristic)."""
    if INTERPRETED or device.type != "cuda":
        return ""
    # The platform probe Platform.device_name comes from, so describe() and a call key the same row.
    return probes.device_name("cuda", device.index if device.index is not None else probes.current_index("cuda"))


def describe(key: spec.Key, platform: Platform) -> str:
    """The launch configuration a call with ``key`` runs, and where it comes from (for explain). The
    key holds T's power-of-two class, so this is the configuration at the class's largest T."""
    name = "" if INTERPRETED or platform.kind != PlatformKind.CUDA else platform.device_name
    tokens = key.num_tokens_class
    config = launch_config(tokens * key.topk, key.num_global_experts, key.quantization, name)
    source = ("measured on this device, perf/decisions/fused_moe.md" if config.tuned
              else f"heuristic: {name or 'this device'} has no measured row for this size")
    return (f"at T = {tokens}: BLOCK_M {config.block_m}; gate-up BN {config.gate_up.block_n} BK {config.gate_up.block_k} "
            f"{config.gate_up.num_warps} warps {config.gate_up.num_stages} stages; down BN {config.down.block_n} "
            f"BK {config.down.block_k} {config.down.num_warps} warps {config.down.num_stages} stages ({source})")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not.
    They read any strides of every input; the device type is checked by the engine."""
    if key.num_experts > MAX_EXPERTS:
        return (f"E = {key.num_experts} local experts > {MAX_EXPERTS}: the routing layout holds every "
                "expert's count in one program")
    if key.weight_dtype == torch.float8_e4m3fnuz:
        return ("e4m3fnuz weights (gfx942's fp8): the kernels quantize and multiply in e4m3fn only "
                "(the aiter backend serves gfx942)")
    if (key.quantization != "none" and platform.kind == PlatformKind.CUDA
            and platform.capability < FP8_DOT_CAPABILITY):
        return (f"{key.quantization} needs fp8 tensor cores (sm_89 or later) for tl.dot on e4m3, "
                f"not {platform.arch}")
    return None


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _fused_moe_kernel

    return _fused_moe_kernel


def _strides(t: Optional[torch.Tensor], rank: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * rank


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
) -> torch.Tensor:
    """The spec's fused_moe in five kernel launches, plus the counts' fill and, for top-k > 1, the fp32
    output's fill and final cast (fp8_per_tensor adds the input's amax); arguments are validated by
    the caller."""
    num_tokens, hidden_size = hidden.shape
    dtype, device = hidden.dtype, hidden.device
    if num_tokens == 0:
        return hidden.new_empty((0, hidden_size))
    experts, inter_size = w1.shape[0], w1.shape[1] // 2
    topk = topk_ids.shape[1]
    pairs = num_tokens * topk
    config = launch_config(pairs, expert_map.shape[0] if expert_map is not None else experts, quantization,
                           _device_name(device))
    block_m = config.block_m
    # Each used expert's run pads to whole blocks: at most min(E, pairs) runs of < block_m padding.
    max_rows = -(-(pairs + min(experts, pairs) * (block_m - 1)) // block_m) * block_m
    max_blocks = max_rows // block_m
    quant = QUANT_MODES[quantization]
    kernels = _kernels()

    counts = torch.zeros(experts, dtype=torch.int32, device=device)
    index = torch.empty(2 * experts + 1 + max_blocks + max_rows, dtype=torch.int32, device=device)
    starts, cursor = index[:experts], index[experts:2 * experts]
    total = index[2 * experts:2 * experts + 1]
    block_expert = index[2 * experts + 1:2 * experts + 1 + max_blocks]
    sorted_pairs = index[2 * experts + 1 + max_blocks:]
    inter = torch.empty((max_rows, inter_size), dtype=dtype, device=device)
    has_map = expert_map is not None
    routing = (topk_ids, expert_map if has_map else topk_ids)
    routing_strides = (*topk_ids.stride(), expert_map.stride(0) if has_map else 0)
    pair_grid = (-(-pairs // PAIRS_PER_PROGRAM),)

    x_scale = amax = counts  # placeholders where the mode reads none
    if quant == QUANT_MODES["fp8_per_tensor"]:
        # The whole expert input's one dynamic scale (quantize_fp8 per_tensor), on the device.
        source = hidden.float() * topk_weights if apply_router_weight_on_input else hidden
        x_scale = (source.abs().amax().float() / FP8_MAX).clamp_min(2.0**-126).reshape(1)
        amax = torch.zeros(1, dtype=torch.float32, device=device)
    accumulate = topk > 1
    if accumulate:
        out = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=device)
    elif has_map:  # a token whose one expert is on another rank gets zeros
        out = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    else:
        out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    blockwise = quantization == "fp8_block"  # [E, row blocks, column blocks] scales, else [E] (or none)
    w1_scale_strides = _strides(w1_scale, 3) if blockwise else (*_strides(w1_scale, 1), 0, 0)
    w2_scale_strides = _strides(w2_scale, 3) if blockwise else (*_strides(w2_scale, 1), 0, 0)
    shared = dict(TOPK=topk, ON_INPUT=apply_router_weight_on_input, QUANT=quant, NATIVE_FP8=native_fp8_cast(device),
                  INTERPRETED=INTERPRETED, BLOCK_M=block_m)

    with device_guard(device):
        kernels.moe_count_kernel[pair_grid](
            *routing, counts, pairs, *routing_strides, TOPK=topk, HAS_MAP=has_map, BLOCK=PAIRS_PER_PROGRAM)
        padded_experts = next_pow2(experts)
        kernels.moe_layout_kernel[(1,)](
            counts, starts, cursor, block_expert, total, experts, max_blocks, BLOCK_M=block_m,
            E_PAD=padded_experts, CHUNK=max(1, min(256, 4096 // padded_experts)))
        kernels.moe_scatter_kernel[pair_grid](
            *routing, cursor, sorted_pairs, pairs, *routing_strides, TOPK=topk, HAS_MAP=has_map,
            BLOCK=PAIRS_PER_PROGRAM)
        layout = (sorted_pairs, block_expert, starts, counts, total)
        gemm = config.gate_up
        kernels.moe_gate_up_kernel[(max_blocks * -(-inter_size // gemm.block_n),)](
            hidden, w1, w1_scale if w1_scale is not None else counts, x_scale, topk_weights, inter, amax,
            *layout, hidden_size, inter_size, max_blocks, *hidden.stride(), *w1.stride(), *w1_scale_strides,
            *topk_weights.stride(), inter.stride(0), GELU=activation == "gelu", BLOCK_N=gemm.block_n,
            BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m, num_warps=gemm.num_warps, num_stages=gemm.num_stages,
            **shared)
        gemm = config.down
        kernels.moe_down_kernel[(max_blocks * -(-hidden_size // gemm.block_n),)](
            inter, w2, w2_scale if w2_scale is not None else counts, amax, topk_weights, out, *layout,
            hidden_size, inter_size, max_blocks, inter.stride(0), *w2.stride(), *w2_scale_strides,
            *topk_weights.stride(), out.stride(0), ACCUMULATE=accumulate, BLOCK_N=gemm.block_n,
            BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m, num_warps=gemm.num_warps, num_stages=gemm.num_stages,
            **shared)
    return out.to(dtype) if accumulate else out
