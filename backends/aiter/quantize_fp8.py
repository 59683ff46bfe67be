"""The aiter backend's quantize_fp8 on ``aiter.dynamic_per_token_scaled_quant`` (per token, and per
1 x group_size group as rows of a group-wide view). Wired and declined: aiter's scale and code
arithmetic is not the spec's bit for bit (QUANTIZE_FP8_REASON), so its static check rejects it."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, QUANTIZE_FP8_REASON, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_fp8 as spec

__all__ = ["quantize_fp8", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/ops/quant.py (dynamic_per_token_scaled_quant,
# per_group_quant_hip: x.view(-1, group_size) for 1 x group scales) and csrc/kernels/quant_kernels.cu.


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """Always a reason (the startup check already gives it): the arithmetic, QUANTIZE_FP8_REASON."""
    return QUANTIZE_FP8_REASON


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_fp8 for per_token and per_group (K % group_size == 0) on aiter's dynamic
    per-row quantizer, kept wired for when the arithmetic agrees; never selected today."""
    import aiter

    if granularity == "per_tensor" or ue8m0:
        raise NotImplementedError("aiter quantize_fp8: per_token and per_group without ue8m0 are wired, nothing else")
    rows, cols = x.shape
    width = group_size if granularity == "per_group" else cols
    codes = torch.empty((rows, cols), dtype=spec.FP8_DTYPES[fp8_dtype], device=x.device)
    scales = torch.empty((rows * (cols // width), 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return codes, spec.in_scale_layout(scales.view(rows, cols // width) if granularity == "per_group" else scales,
                                           scale_layout)
    source = x.contiguous().view(-1, width)

    def call():
        aiter.dynamic_per_token_scaled_quant(out=codes.view(-1, width), input=source, scales=scales)

    first_calls.run(AITER, spec.NAME, (x.dtype, fp8_dtype), WHERE + " (module_quant)", call)
    return codes, spec.in_scale_layout(scales.view(rows, cols // width) if granularity == "per_group" else scales,
                                       scale_layout)
