"""The triton backend's fused_moe: which calls its kernels take, their launch configuration (a
measured table per device, else a heuristic by pairs per expert, with an override for sweeps and
tests) and the launches of one call: the routing layout, fp8_block's input quantization, gate-up GEMM
with the activation fused, down GEMM with the router weight fused, and the top-k sum; or at decode
sizes two GEMVs with no routing layout (kernels: _fused_moe_kernel.py, imported on the first launch so
the backend registers without Triton). No launch reads a device value on the host: every size is a
bound from host ints, and programs past the routed rows return at once."""

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import (FP4_FORMATS, INTERPRETED, device_guard, native_fp8_cast, next_pow2,
                                              platform_table_name, table_name)
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.specs import fused_moe as spec

__all__ = ["GEMV_MAX_TOKENS", "GemmConfig", "LaunchConfig", "MAX_EXPERTS", "describe", "fused_moe", "launch_config",
           "override_launch_config", "supports"]

# The layout kernel holds every local expert's count in one program's registers.
MAX_EXPERTS = 1024
FP8_MAX = 448.0  # e4m3fn
QUANT_MODES = {"none": 0, "fp8_per_tensor": 1, "fp8_block": 2, **FP4_FORMATS}  # _fused_moe_kernel's QUANT
PAIRS_PER_PROGRAM = 256  # the count and scatter kernels: one pair per lane
# Up to this many pairs the routing layout is one program (moe_route_kernel) instead of a fill and three
# launches: Qwen3 T 1 (8 pairs) 30.6 against 37.0 us, T 64 (512) 293.5 against 297.6
# (perf/decisions/fused_moe.md).
ROUTE_ONE_PROGRAM_MAX_PAIRS = 512
REDUCE_MODES = {"atomic": 1, "pairs": 2}  # _fused_moe_kernel's REDUCE for top-k > 1 (LaunchConfig.reduce)
TOP1_STORE = 0  # its REDUCE for top-1: the down kernel stores the output itself
QUANTIZE_GROUPS = 8  # fp8_block input quantization: 1 x 128 groups per program
SUM_BLOCK = 1024  # moe_sum_kernel: columns per program
FP8_DOT_CAPABILITY = (8, 9)  # tl.dot on e4m3 operands: Ada and Hopper tensor cores
FP8_DOT_MIN_K = 32  # tl.dot on e4m3 operands needs K >= 32 (Triton 3.6 on the H200)
# fp4 calls of at most this many tokens take the decode GEMVs: at T = 1 each pair's expert is its own, so a
# program per pair reads every touched expert once (at T > 1 two pairs of one expert would read it twice).
GEMV_MAX_TOKENS = 1
GEMV_QUANTIZATIONS = frozenset({"none", "mxfp4", "nvfp4"})  # fp8's activation quantization is the grouped path's
# Where the GEMVs are chosen: fp4, whose decoding bounds both paths (gpt-oss-120b MXFP4 T 1 on the H200: 49.4
# against 66.0 us). bf16 weights stream faster into the tensor-core tiles, whose loads Triton pipelines (Qwen3
# T 1: gate-up 14.5 against 16.9 us, down 8.6 against 15.6; perf/decisions/fused_moe.md).
GEMV_CHOSEN = frozenset({"mxfp4", "nvfp4"})


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
    """Rows per block of the routing layout (both GEMMs' BLOCK_M), each GEMM's tiles, and how the
    top-k sum is taken for k > 1: "pairs" stores each pair's weighted output in the hidden dtype and
    sums them in one more launch (no fill, no fp32 [T, H]); "atomic" adds them into a zeroed fp32
    [T, H] and casts it (no [T, k, H] buffer). ``gemv``: the decode GEMVs instead (a program per pair,
    then per token, and tile of block_n rows stepping block_k of K; block_m, group_m and reduce unused)."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    reduce: str = "pairs"
    gemv: bool = False
    tuned: bool = False  # from a measured table (perf/decisions/fused_moe.md), else the heuristic


def _heuristic(pairs_per_expert: float, quantization: str) -> LaunchConfig:
    """A cheap default for devices with no table, from the H200's measured rows: the row block follows
    the tokens an expert gets (decode: 16-row blocks, so each touched expert's weights are read once
    and few rows are padding; one 32-row block per expert up to 64 pairs), wide column tiles once
    there are rows enough to reuse them (fp8_block: 64-row blocks, its gate-up tile of 128 x 2 x 128
    is heavier)."""
    block_k = 128 if quantization == "fp8_block" or pairs_per_expert <= 64 else 64
    if pairs_per_expert <= 8:
        tiles = GemmConfig(block_n=64, block_k=block_k, group_m=1, num_warps=4, num_stages=4)
        return LaunchConfig(16, tiles, tiles)
    if pairs_per_expert <= 64:
        tiles = GemmConfig(block_n=128, block_k=block_k, group_m=4, num_warps=4, num_stages=4)
        return LaunchConfig(32, tiles, tiles)
    tiles = GemmConfig(block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)
    return LaunchConfig(64 if quantization == "fp8_block" else 128, tiles, tiles)


def _gemv(gate_up: tuple[int, ...], down: tuple[int, ...], tuned: bool = True) -> LaunchConfig:
    """The decode GEMVs with each GEMM's (block_n, block_k, num_warps, num_stages)."""
    up, down_tiles = ((GemmConfig(n, k, 1, warps, stages)) for n, k, warps, stages in (gate_up, down))
    return LaunchConfig(16, up, down_tiles, gemv=True, tuned=tuned)


# No table row for the device: the GEMVs with the H200's measured MXFP4 tiles (perf/decisions/fused_moe.md).
_GEMV_HEURISTIC = _gemv((8, 512, 4, 3), (8, 1024, 4, 3), tuned=False)


def _measured(block_m: int, gate_up: tuple[int, ...], down: Optional[tuple[int, ...]] = None,
              reduce: str = "pairs") -> LaunchConfig:
    """A table row: BLOCK_M, each GEMM's (block_n, block_k, group_m, num_warps, num_stages) (down:
    gate-up's when None) and the top-k sum."""
    return LaunchConfig(block_m, GemmConfig(*gate_up), GemmConfig(*(down or gate_up)), reduce, tuned=True)


# Measured launch configurations: device name -> (quantization, bucket of pairs per expert
# (lo, hi], configuration); a call in no row takes the heuristic. Each row is the fastest of the sweep
# of perf/diag/fused_moe_goals.py --sweep on that bucket's goal shapes (perf/decisions/fused_moe.md).
_TABLES: dict[str, tuple[tuple[str, float, float, LaunchConfig], ...]] = {
    "NVIDIA H200": (
        # Qwen3 and Mixtral T 1, Qwen3 T 64 (0.06-4 pairs per expert): 30.6, 177.4, 293.5 us.
        ("none", 0, 8, _measured(16, (64, 128, 1, 4, 4))),
        # Mixtral T 64 (16 per expert): 663.7 us, one 32-row block per expert; BM 16 853, BM 64 x BN 64 687.
        ("none", 8, 32, _measured(32, (128, 128, 4, 4, 4))),
        # Qwen3 T 4096 (256 per expert): gate-up 461 us at BN 64, down 288 at BN 128 (each the fastest of
        # 16 by the profiler); "atomic" 1319 against "pairs" 837 (its down 796 against 288 + a 37 us sum).
        ("none", 128, 512, _measured(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3))),
        # Mixtral T 4096 (1024 per expert): 5563 us; BN 64 6431, BM 64 6389-8080, "atomic" 5930.
        ("none", 512, float("inf"), _measured(128, (128, 64, 8, 8, 3))),
        # DeepSeek-V3 T 1 (0.03 per expert) and T 64 (2 per expert), swept while every gate-up program still
        # quantized its own activations: 257 us (4 warps 362) and 5507 (8 warps 5934); with the input
        # quantized once, 117.8 and 2256 us (not swept again).
        ("fp8_block", 0, 1, _measured(16, (128, 128, 1, 8, 3))),
        ("fp8_block", 1, 16, _measured(16, (128, 128, 1, 4, 3))),
        # DeepSeek-V3 T 4096 (128 per expert): 7335 us; down BN 128 7857, BM 128 15571-23743 (gate-up 12.8 ms).
        ("fp8_block", 16, float("inf"), _measured(64, (128, 128, 8, 8, 3), (256, 128, 8, 8, 3))),
        # gpt-oss-120b MXFP4 T 1 (0.03 per expert): 65.2 us; BN 64 78.5, BN 128 106.9, 8 warps 77.4.
        ("mxfp4", 0, 1, _measured(16, (32, 128, 1, 4, 4))),
        # gpt-oss-120b MXFP4 T 64 (2 per expert): 961.8 us; BK 128 1043.8, BN 32 1153.3, BK 256 1248.1.
        ("mxfp4", 1, 8, _measured(16, (64, 64, 1, 4, 4))),
    ),
}
# Measured decode GEMV tiles: device name -> quantization -> configuration (calls of at most GEMV_MAX_TOKENS).
_GEMV_TABLES: dict[str, dict[str, LaunchConfig]] = {
    # gpt-oss-120b MXFP4 T 1: 49.4 us at 8 x 1024 for both; by the profiler gate-up 25.6 us at 8 x 512 (8 x 1024
    # 28.1, 16 x 512 28.1, 4 x 1024 29.5), down 19.6 at 8 x 1024 (4 x 1024 23.5, 16 x 1024 25.4).
    "NVIDIA H200": {"mxfp4": _gemv((8, 512, 4, 3), (8, 1024, 4, 3))},
}


def _config_problem(config: Optional[LaunchConfig]) -> Optional[str]:
    if config is None:
        return None
    if config.block_m < 16 or config.block_m & (config.block_m - 1):
        return f"block_m = {config.block_m}: tl.dot needs a power of two >= 16"
    if config.reduce not in REDUCE_MODES:
        return f"reduce = {config.reduce!r}: expected one of {sorted(REDUCE_MODES)}"
    for gemm in (config.gate_up, config.down):
        for value in (gemm.block_n, gemm.block_k):
            if config.gemv and (value < 1 or value & (value - 1)):
                return f"{gemm}: the GEMVs' tiles are powers of two (tl.arange)"
            if not config.gemv and (value < 16 or value & (value - 1)):
                return f"{gemm}: tl.dot needs tiles that are powers of two >= 16"
    return None


# The launch configuration in force instead of the table's or the heuristic's (None: theirs).
_override: ScopedSetting[Optional[LaunchConfig]] = ScopedSetting("override_launch_config", None, _config_problem)


def override_launch_config(config: LaunchConfig) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Use ``config`` for every call inside the block (sweeps, tests); restores the previous one.
    fp8 calls keep at least 32 as block_k (tl.dot on e4m3), fp8_block exactly 128 (one activation
    group per step) and 128 as gate-up's block_n (its tile is one group of the intermediate); fp4 calls
    at least their scale block (32 mxfp4, 16 nvfp4). A GEMV configuration applies to calls the GEMVs
    serve (GEMV_QUANTIZATIONS) at any T; fp8 calls under it take the table's or the heuristic's."""
    return _override.override(config)


def launch_config(num_tokens: int, topk: int, num_experts: int, quantization: str,
                  device_name: str = "") -> LaunchConfig:
    """The launch configuration for a call of ``num_tokens`` tokens routed to ``topk`` of
    ``num_experts`` (global: a rank's experts get their share): the active override, else for
    decode calls (at most GEMV_MAX_TOKENS, a quantization in GEMV_CHOSEN) the device's measured GEMV
    row or the heuristic GEMVs, else the device's measured row for its bucket of pairs per expert,
    else the heuristic."""
    pairs_per_expert = num_tokens * topk / num_experts
    config = _override.current
    if config is not None and config.gemv and quantization not in GEMV_QUANTIZATIONS:
        config = None
    if config is None and num_tokens <= GEMV_MAX_TOKENS and quantization in GEMV_CHOSEN:
        config = _GEMV_TABLES.get(device_name, {}).get(quantization, _GEMV_HEURISTIC)
    if config is None:
        config = next((row for kind, lo, hi, row in _TABLES.get(device_name, ())
                       if kind == quantization and lo < pairs_per_expert <= hi), None)
    if config is None:
        config = _heuristic(pairs_per_expert, quantization)
    if quantization == "fp8_block":
        config = replace(config, gate_up=replace(config.gate_up, block_n=spec.BLOCK, block_k=spec.BLOCK),
                         down=replace(config.down, block_k=spec.BLOCK))
    elif quantization != "none":  # fp8: tl.dot on e4m3 needs K >= 32; fp4: a step holds whole scale blocks
        least = spec.FP4_BLOCKS.get(quantization, FP8_DOT_MIN_K)
        config = replace(config, gate_up=replace(config.gate_up, block_k=max(config.gate_up.block_k, least)),
                         down=replace(config.down, block_k=max(config.down.block_k, least)))
    return config


def describe(key: spec.Key, platform: Platform) -> str:
    """The launch configuration a call with ``key`` runs, and where it comes from (for explain). The
    key holds T's power-of-two class, so this is the configuration at the class's largest T."""
    name = platform_table_name(platform)
    tokens = key.num_tokens_class
    config = launch_config(tokens, key.topk, key.num_global_experts, key.quantization, name)
    source = ("measured on this device, perf/decisions/fused_moe.md" if config.tuned
              else f"heuristic: {name or 'this device'} has no measured row for this size")
    up, down = config.gate_up, config.down
    kernels = "decode GEMVs" if config.gemv else f"BLOCK_M {config.block_m}"
    return (f"at T = {tokens}: {kernels}; gate-up BN {up.block_n} BK {up.block_k} {up.num_warps} warps "
            f"{up.num_stages} stages; down BN {down.block_n} BK {down.block_k} {down.num_warps} warps "
            f"{down.num_stages} stages ({source})")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not.
    They read any strides of every input; the device type is checked by the engine."""
    if key.num_experts > MAX_EXPERTS:
        return (f"E = {key.num_experts} local experts > {MAX_EXPERTS}: the routing layout holds every "
                "expert's count in one program")
    if key.weight_dtype == torch.float8_e4m3fnuz:
        return ("e4m3fnuz weights (gfx942's fp8): the kernels quantize and multiply in e4m3fn only "
                "(the aiter backend serves gfx942)")
    if (key.quantization.startswith("fp8") and platform.kind == PlatformKind.CUDA
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


def _scale_strides(scale: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """A weight scale's (expert, row (block), column block) strides: [E, ., .] block scales, else [E] or none."""
    return _strides(scale, 3) if scale is not None and scale.dim() == 3 else (*_strides(scale, 1), 0, 0)


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
    """The spec's fused_moe: the routing layout (one launch up to ROUTE_ONE_PROGRAM_MAX_PAIRS pairs,
    else a fill and three), fp8_block's input quantization, gate-up, down, and for top-k > 1 the sum
    (config.reduce "pairs") or an fp32 fill before and a cast after ("atomic"); fp8_per_tensor adds
    the input's amax. fp4 weights (W4A16) are dequantized in both GEMMs' mainloops: no other launch.
    Arguments are validated by the caller."""
    num_tokens, hidden_size = hidden.shape
    dtype, device = hidden.dtype, hidden.device
    if num_tokens == 0:
        return hidden.new_empty((0, hidden_size))
    experts, inter_size = w1.shape[0], w1.shape[1] // 2
    topk = topk_ids.shape[1]
    pairs = num_tokens * topk
    config = launch_config(num_tokens, topk, expert_map.shape[0] if expert_map is not None else experts,
                           quantization, table_name(device))
    if quantization == "nvfp4":  # the kernels decode e4m3 scales from their bits (no fp8 dtype needed)
        w1_scale, w2_scale = w1_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    if config.gemv:
        return _gemv_moe(config, hidden, w1, w2, topk_weights, topk_ids, activation, expert_map,
                         apply_router_weight_on_input, quantization, w1_scale, w2_scale, w1_global_scale,
                         w2_global_scale)
    block_m = config.block_m
    # Each used expert's run pads to whole blocks: at most min(E, pairs) runs of < block_m padding.
    max_rows = -(-(pairs + min(experts, pairs) * (block_m - 1)) // block_m) * block_m
    max_blocks = max_rows // block_m
    quant = QUANT_MODES[quantization]
    blockwise = quantization == "fp8_block"
    kernels = _kernels()

    index = torch.empty(3 * experts + 1 + max_blocks + max_rows, dtype=torch.int32, device=device)
    counts, starts, cursor = index[:experts], index[experts:2 * experts], index[2 * experts:3 * experts]
    total = index[3 * experts:3 * experts + 1]
    block_expert = index[3 * experts + 1:3 * experts + 1 + max_blocks]
    sorted_pairs = index[3 * experts + 1 + max_blocks:]
    has_map = expert_map is not None
    routing = (topk_ids, expert_map if has_map else topk_ids)
    routing_strides = (*topk_ids.stride(), expert_map.stride(0) if has_map else 0)
    padded_experts = next_pow2(experts)
    layout_chunk = max(1, min(256, 4096 // padded_experts))

    x, x_scale, x_scale_stride = hidden, counts, 0  # counts: a placeholder where the mode reads none
    amax = counts
    if quant == QUANT_MODES["fp8_per_tensor"]:
        # The whole expert input's one dynamic scale (quantize_fp8 per_tensor), on the device.
        source = hidden.float() * topk_weights if apply_router_weight_on_input else hidden
        x_scale = (source.abs().amax().float() / FP8_MAX).clamp_min(2.0**-126).reshape(1)
        amax = torch.zeros(1, dtype=torch.float32, device=device)
    if blockwise:  # the input's 1 x 128 groups once, and an fp8 intermediate with its group scales
        x = torch.empty((num_tokens, hidden_size), dtype=w1.dtype, device=device)
        x_scale = torch.empty((num_tokens, -(-hidden_size // spec.BLOCK)), dtype=torch.float32, device=device)
        x_scale_stride = x_scale.stride(0)
        inter = torch.empty((max_rows, inter_size), dtype=w2.dtype, device=device)
        inter_scale = torch.empty((max_rows, -(-inter_size // spec.BLOCK)), dtype=torch.float32, device=device)
    else:
        inter = torch.empty((max_rows, inter_size), dtype=dtype, device=device)
        inter_scale = counts
    # What the down kernel writes: top-1 the output itself, else the fp32 sum or the per-pair rows.
    reduce = REDUCE_MODES[config.reduce] if topk > 1 else TOP1_STORE
    if reduce == REDUCE_MODES["atomic"]:
        down_out = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=device)
    elif reduce == REDUCE_MODES["pairs"]:
        down_out = torch.empty((pairs, hidden_size), dtype=dtype, device=device)
    elif has_map:  # top-1: a token whose one expert is on another rank gets zeros
        down_out = torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    else:
        down_out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
    shared = dict(TOPK=topk, ON_INPUT=apply_router_weight_on_input, QUANT=quant, NATIVE_FP8=native_fp8_cast(device),
                  INTERPRETED=INTERPRETED, BLOCK_M=block_m)
    layout = (sorted_pairs, block_expert, starts, counts, total)

    with device_guard(device):
        if pairs <= ROUTE_ONE_PROGRAM_MAX_PAIRS:
            kernels.moe_route_kernel[(1,)](
                *routing, counts, starts, cursor, block_expert, total, sorted_pairs, pairs, experts, max_blocks,
                *routing_strides, TOPK=topk, HAS_MAP=has_map, BLOCK=PAIRS_PER_PROGRAM, BLOCK_M=block_m,
                E_PAD=padded_experts, CHUNK=layout_chunk)
        else:
            counts.zero_()
            pair_grid = (-(-pairs // PAIRS_PER_PROGRAM),)
            kernels.moe_count_kernel[pair_grid](
                *routing, counts, pairs, *routing_strides, TOPK=topk, HAS_MAP=has_map, BLOCK=PAIRS_PER_PROGRAM)
            kernels.moe_layout_kernel[(1,)](
                counts, starts, cursor, block_expert, total, experts, max_blocks, BLOCK_M=block_m,
                E_PAD=padded_experts, CHUNK=layout_chunk)
            kernels.moe_scatter_kernel[pair_grid](
                *routing, cursor, sorted_pairs, pairs, *routing_strides, TOPK=topk, HAS_MAP=has_map,
                BLOCK=PAIRS_PER_PROGRAM)
        if blockwise:
            kernels.moe_quantize_kernel[(num_tokens, -(-x_scale.shape[1] // QUANTIZE_GROUPS))](
                hidden, topk_weights, x, x_scale, hidden_size, *hidden.stride(), topk_weights.stride(0),
                x.stride(0), x_scale_stride, ON_INPUT=apply_router_weight_on_input,
                NATIVE_FP8=shared["NATIVE_FP8"], GROUPS=QUANTIZE_GROUPS)
        gemm = config.gate_up
        kernels.moe_gate_up_kernel[(max_blocks * -(-inter_size // gemm.block_n),)](
            x, w1, w1_scale if w1_scale is not None else counts,
            w1_global_scale if w1_global_scale is not None else counts, x_scale, topk_weights, inter, inter_scale,
            amax, *layout, hidden_size, inter_size, max_blocks, *x.stride(), x_scale_stride, *w1.stride(),
            *_scale_strides(w1_scale), *_strides(w1_global_scale, 1), *topk_weights.stride(), inter.stride(0),
            inter_scale.stride(0),
            GELU=activation == "gelu", HIDDEN=kernels.HIDDEN_DTYPES[dtype], BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
            GROUP_M=gemm.group_m, num_warps=gemm.num_warps, num_stages=gemm.num_stages, **shared)
        gemm = config.down
        kernels.moe_down_kernel[(max_blocks * -(-hidden_size // gemm.block_n),)](
            inter, inter_scale, w2, w2_scale if w2_scale is not None else counts,
            w2_global_scale if w2_global_scale is not None else counts, amax, topk_weights, down_out,
            *layout, hidden_size, inter_size, max_blocks, inter.stride(0), inter_scale.stride(0), *w2.stride(),
            *_scale_strides(w2_scale), *_strides(w2_global_scale, 1), *topk_weights.stride(), down_out.stride(0),
            REDUCE=reduce, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m, num_warps=gemm.num_warps,
            num_stages=gemm.num_stages, **shared)
        if reduce == TOP1_STORE:
            return down_out
        if reduce == REDUCE_MODES["atomic"]:
            return down_out.to(dtype)
        out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
        kernels.moe_sum_kernel[(num_tokens, -(-hidden_size // SUM_BLOCK))](
            down_out, *routing, out, hidden_size, down_out.stride(0), *routing_strides, out.stride(0), TOPK=topk,
            HAS_MAP=has_map, INTERPRETED=INTERPRETED, BLOCK_N=SUM_BLOCK)
    return out


def _gemv_moe(config: LaunchConfig, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
              expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool, quantization: str,
              w1_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
              w1_global_scale: Optional[torch.Tensor], w2_global_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """fused_moe in two launches (decode): gate-up's GEMV per (pair, column tile) into a [T * k, I]
    intermediate, then down's GEMV per (token, column tile) summing the token's k slots in fp32 (the
    spec allows one rounding of the sum). No routing layout, no fill, no sum launch."""
    num_tokens, hidden_size = hidden.shape
    inter_size = w1.shape[1] // 2
    topk = topk_ids.shape[1]
    kernels = _kernels()
    inter = torch.empty((num_tokens * topk, inter_size), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    has_map = expert_map is not None
    routing = (topk_ids, expert_map if has_map else topk_ids)
    routing_strides = (*topk_ids.stride(), expert_map.stride(0) if has_map else 0)
    placeholder = topk_ids  # where the quantization reads no scales
    shared = dict(TOPK=topk, HAS_MAP=has_map, ON_INPUT=apply_router_weight_on_input, QUANT=QUANT_MODES[quantization],
                  INTERPRETED=INTERPRETED)
    with device_guard(hidden.device):
        gemm = config.gate_up
        kernels.moe_gemv_gate_up_kernel[(num_tokens * topk, -(-inter_size // gemm.block_n))](
            hidden, w1, w1_scale if w1_scale is not None else placeholder,
            w1_global_scale if w1_global_scale is not None else placeholder, topk_weights, *routing, inter,
            hidden_size, inter_size, *hidden.stride(), *w1.stride(), *_scale_strides(w1_scale),
            *_strides(w1_global_scale, 1), topk_weights.stride(0), *routing_strides, inter.stride(0),
            GELU=activation == "gelu", HIDDEN=kernels.HIDDEN_DTYPES[hidden.dtype], BLOCK_N=gemm.block_n,
            BLOCK_K=gemm.block_k, num_warps=gemm.num_warps, num_stages=gemm.num_stages, **shared)
        gemm = config.down
        kernels.moe_gemv_down_kernel[(num_tokens, -(-hidden_size // gemm.block_n))](
            inter, w2, w2_scale if w2_scale is not None else placeholder,
            w2_global_scale if w2_global_scale is not None else placeholder, topk_weights, *routing, out,
            hidden_size, inter_size, inter.stride(0), *w2.stride(), *_scale_strides(w2_scale),
            *_strides(w2_global_scale, 1), *topk_weights.stride(), *routing_strides, out.stride(0),
            BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, num_warps=gemm.num_warps, num_stages=gemm.num_stages,
            **shared)
    return out
