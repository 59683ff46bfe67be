"""The triton backend's scaled_mm: which calls its kernels take, their launch configuration (a measured
table per device, else a heuristic by M, with an override for sweeps and tests) and the launches of
one call: the tiled fp8 GEMM with every scale layout and the bias fused, and where the tiles alone would
leave SMs idle (decode sizes: few rows, the weight stream is the cost), split-K over K with one more
launch summing the slices (kernels: _scaled_mm_kernel.py, imported on the first launch so the backend
registers without Triton). No host sync; graph-safe."""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import (INTERPRETED, compute_units, device_guard, next_pow2, platform_table_name,
                                              table_name)
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.specs import scaled_mm as spec

__all__ = ["LaunchConfig", "describe", "launch_config", "override_launch_config", "scaled_mm", "supports"]

FP8_DOT_CAPABILITY = (8, 9)  # tl.dot on e4m3 operands: Ada and Hopper tensor cores
SCALINGS = {"tensor": 0, "channel": 1, "block": 2}  # _scaled_mm_kernel's SCALING
AUTO = 0  # LaunchConfig.split_k: chosen per call (split_count)
# Split-K: a slice keeps at least this many k-steps (fewer are mostly pipeline fill) and the call
# at most this many slices (each one more fp32 [M, N] through the sum).
MIN_SPLIT_STEPS = 4
MAX_SPLITS = 16
SUM_BLOCK = 1024  # scaled_mm_sum_kernel: elements per program


@dataclass(frozen=True)
class LaunchConfig:
    """Output tile (BLOCK_M x BLOCK_N), k-step (BLOCK_K, dividing 128 so that a step lies in one scale
    group), row tiles sharing a column of b in L2 (GROUP_M), warps, software-pipeline stages, and K
    slices (split_k; AUTO: as many as fill the SMs, split_count)."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = AUTO
    tuned: bool = False  # from a measured table (perf/decisions/scaled_mm.md), else the heuristic


def _heuristic(rows: int) -> LaunchConfig:
    """A cheap default for devices with no table. Decode sizes (M <= 64): one row tile of 16-64 rows
    (each weight byte read once) and narrow column tiles, split-K filling the SMs; up to 256 rows
    64-row tiles; larger, the 128 x 128 tiles of a compute-bound fp8 GEMM."""
    if rows <= 64:
        return LaunchConfig(max(16, next_pow2(rows)), 64, num_warps=4, num_stages=4)
    if rows <= 256:
        return LaunchConfig(64, 128, num_warps=4, num_stages=4)
    return LaunchConfig(128, 128, num_warps=8, num_stages=3, split_k=1)


# Measured launch configurations: device name -> (M bucket (lo, hi], configuration); a call in no
# row takes the heuristic. Each row is the fastest of perf/diag/scaled_mm_goals.py --sweep on the
# bucket's goal shapes (perf/decisions/scaled_mm.md).
_TABLES: dict[str, tuple[tuple[int, float, LaunchConfig], ...]] = {
    "NVIDIA H200": (
        # M 1 / 16, N x K 7168 x 16384, 2048 x 7168, 7168 x 2048, 36864 x 7168: 37.4 / 9.5 / 8.2 / 68.2 and
        # 38.6 / 9.5 / 8.4 / 71.5 us; 4 slices on 7168 x 16384 33.6 / 35.5 (auto: 2), BN 32 and 128 slower.
        (0, 16, LaunchConfig(16, 64, 128, 8, 4, 4, AUTO, tuned=True)),
        # M 64: 45.4 / 12.0 / 10.2 / 83.0 us; whole K 54.5 / 21.7 / 8.8 / 84.7, BN 128 47.8 / 12.0 / 12.2 / 102.4.
        (32, 64, LaunchConfig(64, 64, 128, 8, 4, 4, AUTO, tuned=True)),
        # M 128: 63.5 / 16.3 / 14.8 / 150.6 us; 128 x 128 tiles, 8 warps 86.7 / 14.8 / 19.3 / 150.0, BN 64
        # whole K 73.8 / 21.4 / 11.1 / 162.5.
        (64, 128, LaunchConfig(64, 128, 128, 8, 4, 4, AUTO, tuned=True)),
        # M 4096, 7168 x 16384 / 36864 x 7168: 1578.7 / 3444.4 us; 3 stages 1590.8 / 3460.4, 64 x 128 tiles 1669.2 /
        # 3756.1, 64 x 256 1713.8 / 3806.5, 128 x 256 4530.4 / 10101.9, 4 warps 7299.1 / 15181.2.
        (256, float("inf"), LaunchConfig(128, 128, 128, 8, 8, 4, 1, tuned=True)),
    ),
}


def _config_problem(config: Optional[LaunchConfig]) -> Optional[str]:
    if config is None:
        return None
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            return f"{name} = {value}: tl.dot needs a power of two >= 16"
    if config.block_k < 32 or spec.BLOCK % config.block_k:
        return f"block_k = {config.block_k}: e4m3 dots need >= 32, and a step must lie in one 128 group"
    if config.split_k < 0:
        return f"split_k = {config.split_k}: expected {AUTO} (auto) or a slice count >= 1"
    return None


# The launch configuration in force instead of the table's or the heuristic's (None: theirs).
_override: ScopedSetting[Optional[LaunchConfig]] = ScopedSetting("override_launch_config", None, _config_problem)


def override_launch_config(config: LaunchConfig) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Use ``config`` for every call inside the block (sweeps, tests); restores the previous one."""
    return _override.override(config)


def launch_config(rows: int, device_name: str = "") -> LaunchConfig:
    """The launch configuration for a call of ``rows`` (M): the active override, else the device's
    measured row for its bucket of M, else the heuristic."""
    config = _override.current
    if config is None:
        config = next((row for lo, hi, row in _TABLES.get(device_name, ()) if lo < rows <= hi), None)
    return config if config is not None else _heuristic(rows)


def split_count(config: LaunchConfig, rows: int, cols: int, depth: int, units: int) -> int:
    """K slices for a call: the configuration's, else (AUTO) the fewest that give every one of
    ``units`` SMs a program, each slice keeping MIN_SPLIT_STEPS k-steps, at most MAX_SPLITS; never
    more than K has steps."""
    steps = -(-depth // config.block_k)
    if config.split_k != AUTO:
        return max(1, min(config.split_k, steps))
    tiles = -(-rows // config.block_m) * -(-cols // config.block_n)
    wanted = -(-units // tiles)
    return max(1, min(wanted, MAX_SPLITS, steps // MIN_SPLIT_STEPS))


def describe(key: spec.Key, platform: Platform) -> str:
    """The launch configuration a call with ``key`` runs, and where it comes from (for explain). The
    key holds M's power-of-two class, so this is the configuration at the class's largest M."""
    name = platform_table_name(platform)
    rows = key.m_class
    config = launch_config(rows, name)
    source = ("measured on this device, perf/decisions/scaled_mm.md" if config.tuned
              else f"heuristic: {name or 'this device'} has no measured row for this size")
    split = ("K split to fill the SMs" if config.split_k == AUTO
             else f"K in {config.split_k} slices" if config.split_k > 1 else "whole K")
    return (f"at M = {rows}: tile {config.block_m} x {config.block_n}, BK {config.block_k}, {config.num_warps} warps "
            f"{config.num_stages} stages, {split} ({source})")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not.
    They read any strides of every input and every scale layout; the device type is checked by the
    engine."""
    if key.fp8_dtype != torch.float8_e4m3fn:
        return (f"{key.fp8_dtype} operands: the kernels multiply e4m3fn codes; e4m3fnuz (gfx942's fp8) "
                "is the aiter backend's")
    if platform.kind == PlatformKind.CUDA and platform.capability < FP8_DOT_CAPABILITY:
        return f"fp8 tensor cores (sm_89 or later) for tl.dot on e4m3, not {platform.arch}"
    return None


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _scaled_mm_kernel

    return _scaled_mm_kernel


def _scale_strides(scale: torch.Tensor) -> tuple[int, int]:
    """A scale's (row, column) strides: [rows, groups] block scales, [rows, 1] channel scales (the
    column never stepped), 0-d or [1] per-tensor scales (never stepped)."""
    return (scale.stride(0), scale.stride(1)) if scale.dim() == 2 else (0, 0)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm: one launch, or with split-K the slices' fp32 sums and a launch adding
    them (and the bias). Arguments are validated by the caller."""
    rows, depth = a.shape
    cols = b.shape[0]
    device = a.device
    out = torch.empty((rows, cols), dtype=spec.OUT_DTYPES[out_dtype], device=device)
    if rows == 0:
        return out
    config = launch_config(rows, table_name(device))
    splits = split_count(config, rows, cols, depth, compute_units(device))
    k_per_split = -(-depth // (splits * config.block_k)) * config.block_k
    splits = -(-depth // k_per_split)  # no empty slice
    kernels = _kernels()
    target = out
    if splits > 1:
        target = torch.empty((splits, rows, cols), dtype=torch.float32, device=device)
    tiles = -(-rows // config.block_m) * -(-cols // config.block_n)
    bias_stride = bias.stride(0) if bias is not None else 0
    with device_guard(device):
        kernels.scaled_mm_kernel[(tiles, splits)](
            a, b, scale_a, scale_b, bias if bias is not None else out, target, rows, cols, depth, k_per_split,
            *a.stride(), *b.stride(), *_scale_strides(scale_a), *_scale_strides(scale_b), bias_stride,
            target.stride(0) if splits > 1 else 0, target.stride(-2),
            SCALING=SCALINGS[spec.validated_scaling(scale_a, scale_b, cols)], HAS_BIAS=bias is not None,
            INTERPRETED=INTERPRETED, SPLIT_K=splits,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            num_warps=config.num_warps, num_stages=config.num_stages)
        if splits > 1:
            size = rows * cols
            kernels.scaled_mm_sum_kernel[(-(-size // SUM_BLOCK),)](
                target, bias if bias is not None else out, out, cols, size, target.stride(0), bias_stride,
                HAS_BIAS=bias is not None, SPLIT_K=splits, BLOCK=SUM_BLOCK)
    return out
