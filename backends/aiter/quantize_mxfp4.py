"""The aiter backend's quantize_mxfp4 on ``aiter.utility.fp4_utils.dynamic_mxfp4_quant`` (Triton, linear
scales). Wired and declined: its shared-scale rounding ("even") is neither of the spec's
(QUANTIZE_MXFP4_REASON), so its static check rejects it."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, QUANTIZE_MXFP4_REASON
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_mxfp4 as spec
from kernelmux.specs.quantize_nvfp4 import in_scale_layout, scale_shape

__all__ = ["quantize_mxfp4", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/utility/fp4_utils.py dynamic_mxfp4_quant and
# _dynamic_mxfp4_quant_kernel_asm_layout (shuffle=False: scales [M, K/32] trimmed of the padding).


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """Always a reason (the startup check already gives it): the rounding, QUANTIZE_MXFP4_REASON."""
    return QUANTIZE_MXFP4_REASON


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """dynamic_mxfp4_quant's codes and linear e8m0 scales as uint8, kept wired for when the roundings
    agree; never selected today."""
    from aiter.utility.fp4_utils import dynamic_mxfp4_quant

    rows, cols = x.shape
    if rows == 0:
        return (torch.empty((0, cols // 2), dtype=torch.uint8, device=x.device),
                torch.empty(scale_shape(0, cols // spec.BLOCK, scale_layout), dtype=torch.uint8, device=x.device))

    def call():
        return dynamic_mxfp4_quant(x=x, scaling_mode="even", shuffle=False)

    q, scale = first_calls.run(AITER, spec.NAME, x.dtype, "Triton's cache", call)
    return q.view(torch.uint8), in_scale_layout(scale.view(torch.uint8), scale_layout)
