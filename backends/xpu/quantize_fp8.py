"""The xpu backend's quantize_fp8 on vllm-xpu-kernels' dynamic FP8 quantizers (csrc/quantization/fp8/
fp8_quant.cpp). Wired and declined: their codes are ``x * (1 / scale)`` and their scale floors are
not the spec's, so codes and scales are not the spec's bit for bit (``DECLINED``)."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import quantize_fp8 as spec

__all__ = ["DECLINED", "quantize_fp8", "supports"]

# fp8_quant.cpp: every kernel quantizes with ConvertWithScaleOp<true> on 1.0f / scale (quant_utils.h:
# src * scale), where the spec divides (a last-bit difference crosses an e4m3 rounding boundary for
# some inputs); the dynamic scales are amax / 448 with no floor per tensor (an all-zero input gets
# scale 0 and NaN codes), and max(amax / 448, 1 / (448 * 512)) per token and per group
# (min_scaling_factor: rows and groups with amax below 1/512 get another scale than the spec's).
DECLINED = ("the vendor's FP8 quantizers multiply by 1 / scale where the spec divides, and floor the scale "
            "at 1 / (448 * 512) per token and group (none per tensor), not at the spec's 2^-126 or 1e-4 / 448 "
            "(fp8_quant.cpp): codes and scales are not the spec's bit for bit")
FP8_MIN, FP8_MAX = -448.0, 448.0


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """Always the reason (also the entry's static check): the arithmetic differs from the spec's."""
    return DECLINED


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_fp8 on the vendor's quantizers (kept wired for when the arithmetic agrees;
    declined today): per_tensor on dynamic_scaled_fp8_quant, per_token on
    dynamic_per_token_scaled_fp8_quant, per_group on per_token_group_fp8_quant (with the spec's amax
    floor as its eps; the group size must divide K)."""
    import vllm_xpu_kernels._C  # noqa: F401 - registers torch.ops._C

    rows, cols = x.shape
    source = x.contiguous()
    q = torch.empty((rows, cols), dtype=spec.FP8_DTYPES[fp8_dtype], device=x.device)
    if granularity == "per_tensor":
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        torch.ops._C.dynamic_scaled_fp8_quant(result=q, input=source, scale=scale)
    elif granularity == "per_token":
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        torch.ops._C.dynamic_per_token_scaled_fp8_quant(result=q, input=source, scale=scale, scale_ub=None)
    else:
        scale = torch.empty((rows, cols // group_size), dtype=torch.float32, device=x.device)
        torch.ops._C.per_token_group_fp8_quant(
            input=source, output_q=q, output_s=scale, group_size=group_size, eps=spec.GROUP_AMAX_FLOOR,
            fp8_min=FP8_MIN, fp8_max=FP8_MAX, scale_ue8m0=ue8m0, dummy_is_scale_transposed=False,
            dummy_is_tma_aligned=False,
        )
    return q, spec.in_scale_layout(scale, scale_layout)
