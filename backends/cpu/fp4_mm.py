"""The cpu backend's fp4_mm, W4A16 and W4A4 in both formats: the weights decoded to fp32 a chunk of rows at
a time into reused buffers (_fp4: the reference's dequantized values, bit for bit) and multiplied there by
fp32 GEMMs, so no fp32 copy of the whole weight is made; W4A4's activations (few rows) decoded once."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu import _fp4
from kernelmux.specs import fp4_mm as spec

__all__ = ["fp4_mm"]

# Weights decoded per GEMM: 4 MiB of fp32, the fused_moe backend's chunk (perf/decisions/fused_moe.md).
CHUNK_ELEMENTS = 1 << 20


def fp4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str = "nvfp4",
    a_scale: Optional[torch.Tensor] = None,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
    out_dtype: str = "bfloat16",
) -> torch.Tensor:
    """The spec's fp4_mm; arguments are validated by the caller."""
    rows, channels = a.shape[0], b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if rows == 0:
        return torch.empty((0, channels), dtype=dtype)
    if a.dtype == torch.uint8:  # W4A4: the activations' codes decoded once, as the weights' are
        half = a.shape[1]
        activations = _fp4.decode(a, a_scale, a_global_scale, fmt, torch.empty(2 * a.numel(), dtype=torch.float32),
                                  torch.empty(rows * half, dtype=torch.int32))
    else:
        activations = a.float()
    # The GEMM's result is [N, M] transposed; the spec's output (and its fake's) is a contiguous [M, N].
    out = torch.empty((rows, channels), dtype=dtype)
    return out.copy_(_fp4.gemm(activations, b, b_scale, b_global_scale, fmt, CHUNK_ELEMENTS))
