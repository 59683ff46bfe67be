"""The cuda backend's quantize_nvfp4 (kernel and launch: _quantize_fp4.py, kernels/quantize_fp4.cu): a passed-in
global scale in one launch, a dynamic one in two (per-CTA maxima, then the codes); either scale layout."""

# No `from __future__ import annotations` here: the signature must equal the spec's (evaluated types).

from typing import Optional

import torch

from kernelmux.backends.cuda import _quantize_fp4 as fp4
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_nvfp4 as spec

__all__ = ["describe", "quantize_nvfp4", "supports"]


def _format(key_or_scale) -> str:
    return "nvfp4_dynamic" if key_or_scale is None else "nvfp4_given"


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel computes calls with this key as the spec defines them, else why not."""
    return (fp4.platform_reason(platform.capability, platform.arch)
            or fp4.shape_reason(key.x_dtype, key.k, spec.BLOCK, key.x_layout.dense_rows))


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain)."""
    return fp4.describe(_format(key.global_scale_layout), key.x_dtype)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's quantize_nvfp4 on the cuda kernel; arguments are validated by the caller and accepted by
    supports (a direct call it cannot compute raises ValueError before any launch)."""
    fp4.check_call(x, spec.BLOCK)
    q, block_scale, gs = spec.fake(x, global_scale, scale_layout)  # the spec's shapes, on x's device
    if x.shape[0] == 0:  # the amax of nothing is 0: gs 1, or the one passed in (a copy, no kernel of ours)
        gs.copy_(global_scale.reshape(()) if global_scale is not None else torch.ones((), device=x.device))
        return q, block_scale, gs
    fp4.quantize(x, _format(global_scale), q, block_scale.view(torch.uint8), scale_layout == "swizzled_128x4",
                 gs_in=global_scale, gs_out=gs)
    return q, block_scale, gs
