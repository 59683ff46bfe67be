"""The cpu backend's quantize_fp8: the spec's arithmetic (its scales, IEEE divisions, torch's round-to-nearest-even
saturating cast) over blocks of rows that stay in cache, each group's scale broadcast to its elements rather
than expanded into a divisor the size of the input."""

from __future__ import annotations

import torch

from kernelmux.specs import quantize_fp8 as spec

# Elements of a block of rows (its fp32 copy 4 MiB, in cache between the maxima, the division and the cast).
# 2-core x86_64 VM, best of 10, us for DeepSeek-V3 M 128 / M 1024 per_group and Llama-3 M 1024 per_token:
# 1 << 16: 1743 / 13379 / 5912; 1 << 18: 781 / 6972 / 3232; 1 << 20: 484 / 4780 / 2302; one block: 471 / 22730 /
# 4271 (the reference in that run: 1364 / 67816 / 7838).
BLOCK_ELEMENTS = 1 << 20


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_fp8; arguments are validated by the caller. Each block of rows is widened to
    fp32 once; its maxima, scales, quotients and codes come from that copy."""
    rows, cols = x.shape
    fp8 = spec.FP8_DTYPES[fp8_dtype]
    fp8_max = spec.FP8_MAX[fp8_dtype]
    if granularity == "per_tensor":
        amax = torch.zeros(1, dtype=torch.float32)
        if x.numel():  # max(-min, max): one pass in x's dtype, no |x| tensor (1024 x 4096 bf16: 252 against 1082 us)
            low, high = torch.aminmax(x)
            amax = torch.maximum(-low, high).float().reshape(1)
        scale = spec.scale_from_amax(amax, granularity, ue8m0, fp8_dtype)
    block_rows = max(1, BLOCK_ELEMENTS // cols)
    if rows <= block_rows:  # one block: no copies of the scales, and the cast allocates the codes
        values = x.float().contiguous()  # (.to(memory_format=) keeps a strided fp32 x as it is)
        if granularity != "per_tensor":
            scale = _block_scale(values, granularity, group_size, ue8m0, fp8_dtype)
        quotients = _divided(values, scale, granularity, group_size, in_place=values is not x)
        return quotients.clamp_(-fp8_max, fp8_max).to(fp8), spec.in_scale_layout(scale, scale_layout)
    q = torch.empty((rows, cols), dtype=fp8)
    if granularity != "per_tensor":
        scale = spec.fake(x, granularity, group_size, scale_layout=scale_layout)[1]
    for start in range(0, rows, block_rows):
        stop = min(rows, start + block_rows)
        values = torch.empty((stop - start, cols), dtype=torch.float32)
        values.copy_(x[start:stop])  # any input strides; fp32 input copied too (the division is in place)
        if granularity != "per_tensor":
            scale[start:stop] = block_scale = _block_scale(values, granularity, group_size, ue8m0, fp8_dtype)
        else:
            block_scale = scale
        q[start:stop].copy_(_divided(values, block_scale, granularity, group_size, in_place=True)
                            .clamp_(-fp8_max, fp8_max))  # torch's saturating round-to-nearest-even cast
    return q, scale


def _block_scale(values: torch.Tensor, granularity: str, group_size: int, ue8m0: bool,
                 fp8_dtype: str) -> torch.Tensor:
    """The scales of a block's fp32 rows (per_group [n, groups], per_token [n, 1])."""
    if granularity == "per_token":
        amax = values.abs().amax(dim=1, keepdim=True)
    else:
        ragged = values.shape[1] % group_size
        padded = torch.nn.functional.pad(values, (0, group_size - ragged)) if ragged else values  # zeros: same max
        amax = padded.view(values.shape[0], -(-values.shape[1] // group_size), group_size).abs().amax(dim=-1)
    return spec.scale_from_amax(amax, granularity, ue8m0, fp8_dtype)


def _divided(values: torch.Tensor, scale: torch.Tensor, granularity: str, group_size: int,
             in_place: bool) -> torch.Tensor:
    """values / scale, each group's, row's or the tensor's scale broadcast (IEEE: a tensor divisor)."""
    rows, cols = values.shape
    if granularity == "per_group" and cols % group_size:  # a shorter last group: one divisor per element
        scale = scale.repeat_interleave(group_size, dim=1)[:, :cols]
    elif granularity == "per_group":
        grouped = values.view(rows, cols // group_size, group_size)
        return (grouped.div_(scale[:, :, None]) if in_place else grouped / scale[:, :, None]).view(rows, cols)
    return values.div_(scale) if in_place else values / scale
