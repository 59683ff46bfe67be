"""The cpu backend's quantize_mxfp4: the reference's arithmetic, bit for bit, in fewer passes and calls: x widened
to fp32 once per step, one block maximum whose finiteness also marks the NaN / Inf blocks (amax propagates NaN),
the power-of-two divisors from a table by code, and the codes by _fp4.encode_packed."""

import torch

from kernelmux.backends.cpu._fp4 import SCALE_VALUES, encode_packed, widened
from kernelmux.backends.cpu.quantize_nvfp4 import STEP_ELEMENTS  # measured there, for both formats
from kernelmux.specs import quantize_mxfp4 as spec
from kernelmux.specs._arith import ieee_div
from kernelmux.specs.quantize_nvfp4 import in_scale_layout

__all__ = ["quantize_mxfp4"]


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_mxfp4; arguments are validated by the caller (swizzled scales: the linear ones
    swizzled, as quantize_nvfp4's)."""
    rows, cols = x.shape
    blocks = cols // spec.BLOCK
    q = torch.empty((rows, cols // 2), dtype=torch.uint8)
    scale = torch.empty((rows, blocks), dtype=torch.uint8)
    step = max(1, STEP_ELEMENTS // cols)
    for first in range(0, rows, step):
        part = slice(first, first + step)
        values = widened(x[part]).view(-1, blocks, spec.BLOCK)
        block_amax = values.abs().amax(dim=-1)  # NaN or Inf where the block holds one
        finite = block_amax.isfinite()
        if rounding == "floor":
            exponent = torch.frexp(block_amax).exponent.sub_(1 + spec.E2M1_EMAX)
        else:
            mantissa, exponent = torch.frexp(ieee_div(block_amax, 6.0))
            exponent -= (mantissa == 0.5).to(torch.int32)  # d a power of two: d itself
        code = exponent.clamp_(spec.EXPONENT_MIN, spec.EXPONENT_MAX).add_(spec.E8M0_BIAS)
        divisor = SCALE_VALUES["mxfp4"][code]
        keep = finite & block_amax.ne(0)
        scale[part] = torch.where(finite, code.mul_(keep), spec.E8M0_NAN)  # zero blocks: code 0
        encode_packed(values.div_(divisor.unsqueeze_(-1)), keep.to(torch.uint8), out=q[part])
    return q, in_scale_layout(scale, scale_layout)
