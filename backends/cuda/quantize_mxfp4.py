"""The cuda backend's quantize_mxfp4 (kernel and launch: _quantize_fp4.py, kernels/quantize_fp4.cu): one launch,
OCP's floor or the ceil scale rule, either scale layout."""

# No `from __future__ import annotations` here: the signature must equal the spec's (evaluated types).

from typing import Optional

import torch

from kernelmux.backends.cuda import _quantize_fp4 as fp4
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_mxfp4 as spec

__all__ = ["describe", "quantize_mxfp4", "supports"]


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel computes calls with this key as the spec defines them, else why not."""
    return (fp4.platform_reason(platform.capability, platform.arch)
            or fp4.shape_reason(key.x_dtype, key.k, spec.BLOCK, key.x_layout.dense_rows))


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain)."""
    return fp4.describe(key.rounding, key.x_dtype)


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_mxfp4 on the cuda kernel; arguments are validated by the caller and accepted by
    supports (a direct call it cannot compute raises ValueError before any launch)."""
    fp4.check_call(x, spec.BLOCK)
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"rounding: 'floor' or 'ceil' expected, got {rounding!r}")
    q, scale = spec.fake(x, rounding, scale_layout)  # the spec's shapes, on x's device
    if x.shape[0] == 0:
        return q, scale
    fp4.quantize(x, rounding, q, scale, scale_layout == "swizzled_128x4")
    return q, scale
