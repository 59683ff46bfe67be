"""The cpu backend's quantize_nvfp4: the reference's arithmetic, bit for bit, in fewer passes and calls: x widened
to fp32 once per step, the global amax from the block maxima, the codes by _fp4.encode_packed (a search for few
values, integer passes for many), and rows STEP_ELEMENTS at a time (a dynamic global scale over several steps
reads x twice: once for the maxima, once to quantize)."""

from typing import Optional

import torch

from kernelmux.backends.cpu._fp4 import encode_packed, widened
from kernelmux.specs import quantize_nvfp4 as spec
from kernelmux.specs._arith import ieee_div

__all__ = ["quantize_nvfp4"]

# Values per step: 2-core VM, ms at DeepSeek-V3 T 128 / T 1024 and Llama-3-8B T 1024 (x 7168, 7168, 4096):
# 3.4 / 28.4 / 17.5 at 2^20, against 6.3 / 31.6 / 17.5 at 2^18, 5.1 / 50.5 / 32.0 at 2^16 and 4.0 / 39.0 / 22.1
# at 2^22 (reference 6.8 / 39.0 / 40.0); one step up to it widens x once.
STEP_ELEMENTS = 1 << 20


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's quantize_nvfp4; arguments are validated by the caller. Swizzled scales: the linear ones
    swizzled (spec.swizzle_128x4), a copy of the scale bytes (1/8 of the codes')."""
    q, sf, gs = _linear(x, global_scale)
    return q, spec.in_scale_layout(sf, scale_layout), gs


def _linear(x: torch.Tensor,
            global_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_nvfp4 with linear block scales."""
    rows, cols = x.shape
    blocks = cols // spec.BLOCK
    q = torch.empty((rows, cols // 2), dtype=torch.uint8)
    step = max(1, STEP_ELEMENTS // cols)
    if rows <= step:  # one step: widened once, the maxima and the codes from the same copy
        values = widened(x).view(rows, blocks, spec.BLOCK)
        block_amax = values.abs().amax(dim=-1)
    else:
        values = None
        block_amax = torch.empty((rows, blocks), dtype=torch.float32)
        for first in range(0, rows, step):
            part = widened(x[first:first + step]).abs_().view(-1, blocks, spec.BLOCK)
            torch.amax(part, dim=-1, out=block_amax[first:first + part.shape[0]])
    if global_scale is not None:
        gs = global_scale.float().reshape(()).clone()
    else:
        amax = block_amax.max() if rows else None
        # A tensor numerator: float / tensor is a reciprocal, then a product (two roundings).
        gs = torch.full((), spec.GLOBAL_NUMERATOR) / amax if amax is not None and amax > 0 else torch.ones(())
    if rows == 0:
        return q, torch.empty((0, blocks), dtype=torch.float8_e4m3fn), gs
    sf = ieee_div(block_amax.mul_(gs), spec.E2M1_MAX).clamp_max_(spec.E4M3_MAX).to(torch.float8_e4m3fn)
    sf_value = sf.float()
    ratio = (gs / sf_value).unsqueeze_(-1)  # inf where sf = 0: those blocks' codes are zeroed by keep
    keep = sf_value.ne_(0).to(torch.uint8)
    if values is not None:
        return encode_packed(values.mul_(ratio), keep, out=q), sf, gs
    for first in range(0, rows, step):
        part = widened(x[first:first + step]).view(-1, blocks, spec.BLOCK)
        encode_packed(part.mul_(ratio[first:first + step]), keep[first:first + step], out=q[first:first + step])
    return q, sf, gs
