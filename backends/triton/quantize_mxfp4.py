"""The triton backend's quantize_mxfp4, every call the spec allows, in one launch (kernels:
_quantize_fp4_kernel.py, imported on the first launch so the backend registers without Triton)."""

import functools

import torch

from kernelmux.backends.triton._host import device_guard, next_pow2
# The program's tile, quantize_nvfp4's: both measured in the same runs (perf/decisions/quantize_mxfp4.md).
from kernelmux.backends.triton.quantize_nvfp4 import BLOCK_K, PROGRAM_ROWS_FROM, ROWS
from kernelmux.specs import quantize_mxfp4 as spec

__all__ = ["quantize_mxfp4"]


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _quantize_fp4_kernel

    return _quantize_fp4_kernel


def quantize_mxfp4(x: torch.Tensor, rounding: str = "floor",
                   scale_layout: str = "linear") -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_mxfp4; arguments are validated by the caller."""
    rows, cols = x.shape
    q, scale = spec.fake(x, rounding, scale_layout)  # the spec's shapes, on x's device
    swizzled = scale_layout == "swizzled_128x4"
    if swizzled:
        scale.zero_()  # the padding's scale codes are 0; the kernel writes the rest
    if rows == 0:
        return q, scale
    block_rows = ROWS if rows >= PROGRAM_ROWS_FROM else 1
    with device_guard(x.device):
        _kernels().quantize_mxfp4_kernel[(-(-rows // block_rows), -(-cols // BLOCK_K))](
            x, q, scale, rows, cols, *x.stride(), q.stride(0), scale.stride(0), CEIL=rounding == "ceil",
            ROWS=block_rows, BLOCK_K=min(BLOCK_K, next_pow2(cols)), SWIZZLED=swizzled)
    return q, scale
