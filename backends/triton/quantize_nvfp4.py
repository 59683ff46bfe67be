"""The triton backend's quantize_nvfp4, every call the spec allows (kernels: _quantize_fp4_kernel.py, imported on
the first launch so the backend registers without Triton): one launch with a passed-in global scale or up to
ONE_PROGRAM_MAX_ROWS rows (every program reads all of x for the global scale), else a zeroed fp32 and
quantize_fp8's amax pass into it first (atomic max; no host sync)."""

import functools
from typing import Optional

import torch

from kernelmux.backends.triton._host import device_guard, native_fp8_cast, next_pow2
from kernelmux.backends.triton.quantize_fp8 import BLOCK_K as AMAX_BLOCK_K
from kernelmux.backends.triton.quantize_fp8 import ROWS as AMAX_ROWS
from kernelmux.specs import quantize_nvfp4 as spec

__all__ = ["quantize_nvfp4"]

# Columns (whole blocks) per program, and rows: 1, or ROWS from PROGRAM_ROWS_FROM rows on (perf/decisions/
# quantize_nvfp4.md: H200, bf16, T 1 / 128 / 4096).
BLOCK_K = 1024
ROWS = 4
PROGRAM_ROWS_FROM = 1024
ONE_PROGRAM_MAX_ROWS = 4  # up to this many rows every program reads all of x for the dynamic global scale


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _quantize_fp4_kernel, _quantize_fp8_kernel

    return _quantize_fp4_kernel, _quantize_fp8_kernel


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's quantize_nvfp4; arguments are validated by the caller."""
    rows, cols = x.shape
    q, block_scale, gs = spec.fake(x, global_scale, scale_layout)  # the spec's shapes, on x's device
    swizzled = scale_layout == "swizzled_128x4"
    if swizzled:
        block_scale.view(torch.uint8).zero_()  # the padding's scales are 0; the kernel writes the rest
    if rows == 0:  # the amax of nothing is 0: gs 1, or the one passed in
        gs.copy_(global_scale.reshape(()) if global_scale is not None else torch.ones((), device=x.device))
        return q, block_scale, gs
    fp4, fp8 = _kernels()
    amax = gs  # a placeholder unless the global scale takes a first pass
    if global_scale is not None:
        mode = fp4.GIVEN
    elif rows <= ONE_PROGRAM_MAX_ROWS:
        mode = fp4.TILE
    else:
        mode = fp4.AMAX
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)  # amax_partials_kernel's atomic max
    block_rows = ROWS if rows >= PROGRAM_ROWS_FROM else 1
    with device_guard(x.device):
        if mode == fp4.AMAX:
            fp8.amax_partials_kernel[(-(-rows // AMAX_ROWS),)](x, amax, rows, cols, *x.stride(), ROWS=AMAX_ROWS,
                                                               BLOCK_K=AMAX_BLOCK_K, ATOMIC=True)
        fp4.quantize_nvfp4_kernel[(-(-rows // block_rows), -(-cols // BLOCK_K))](
            x, q, block_scale.view(torch.uint8), global_scale if global_scale is not None else gs, gs, amax,
            rows, cols, *x.stride(), q.stride(0), block_scale.stride(0),
            GS=mode, NATIVE_FP8=native_fp8_cast(x.device), ROWS=block_rows, BLOCK_K=min(BLOCK_K, next_pow2(cols)),
            TILE_ROWS=ONE_PROGRAM_MAX_ROWS, SWIZZLED=swizzled)
    return q, block_scale, gs
