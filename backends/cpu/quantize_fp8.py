"""The cpu backend's quantize_fp8: the spec's arithmetic (its scales, IEEE divisions, torch's round-to-nearest-even
saturating cast) over blocks of rows that stay in cache, each group's scale broadcast to its elements rather
than expanded into a divisor the size of the input; a call with one scale (per_tensor, or per_token over one
row) computes it on the host."""

from __future__ import annotations

import numpy as np
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
    fp32 once; its maxima, scales, quotients and codes come from that copy. One per_token row is divided
    as it is (the [1, 1] fp32 scale promotes the quotient to fp32)."""
    rows, cols = x.shape
    fp8 = spec.FP8_DTYPES[fp8_dtype]
    if granularity == "per_tensor":
        amax = 0.0
        if x.numel():  # max(-min, max): one pass in x's dtype, no |x| tensor (1024 x 4096 bf16: 252 against 1082 us)
            low, high = torch.aminmax(x)
            amax = max(-low.item(), high.item())
        scale = _one_scale(amax, ue8m0, fp8_dtype, shape=(1,))
    elif granularity == "per_token" and rows == 1:  # a decode row: its scale on the host, two torch calls for codes
        scale = _one_scale(x.abs().amax().item(), ue8m0, fp8_dtype, shape=(1, 1))
        return torch.div(x, scale).to(fp8).contiguous(), scale
    block_rows = max(1, BLOCK_ELEMENTS // cols)
    # The casts below need no clamp to +-fp8_max first: a quotient exceeds it by an ulp at most (x <= amax =
    # fp8_max scale, to rounding), and torch's cast rounds that to fp8_max (e4m3fn's cast saturates anyway).
    if rows <= block_rows:  # one block: no copies of the scales, and the cast allocates the codes
        values = x.float().contiguous()  # (.to(memory_format=) keeps a strided fp32 x as it is)
        if granularity != "per_tensor":
            scale = _block_scale(values, granularity, group_size, ue8m0, fp8_dtype)
        quotients = _divided(values, scale, granularity, group_size, in_place=values is not x)
        return quotients.to(fp8), spec.in_scale_layout(scale, scale_layout)
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
        q[start:stop].copy_(_divided(values, block_scale, granularity, group_size, in_place=True))
    return q, scale


def _one_scale(amax: float, ue8m0: bool, fp8_dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """spec.scale_from_amax of one per_tensor or per_token maximum, on the host (numpy's fp32 scalars instead
    of four torch calls): max(amax / fp8_max, 2^-126), the division an IEEE fp32 one, ue8m0 rounded up on the
    bits; a tensor of ``shape``."""
    scale = max(np.float32(amax) / np.float32(spec.FP8_MAX[fp8_dtype]), np.float32(spec.SCALE_FLOOR))
    if ue8m0:
        bits = np.array(scale, dtype=np.float32).view(np.int32)
        scale = ((bits + np.int32(0x007FFFFF)) & np.int32(-0x00800000)).view(np.float32)
    return torch.full(shape, float(scale), dtype=torch.float32)


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
