"""The cpu backend's scaled_mm: the reference's fp32 products and fp32 GEMM, with the weights dequantized a
block of rows at a time (in cache, never a full fp32 copy of b) through the fast exact fp8 -> fp16 route of
_fp8.py, and each scale broadcast over its group or block instead of expanded to the operand's size."""

# Every dequantized element is the reference's bits: the route gives fp8 value / 2^8 (e4m3fnuz: / 2^7)
# exactly, and multiplying by scale * 2^8 (exact: a power of two) rounds the product fp8 value * scale
# once, as the reference's a.float() * scale does. Only the GEMM's summation order differs (several
# calls over blocks of b's rows), which the spec's tolerance allows.

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._fp8 import ROUTE_SCALES, fp8_as_half
from kernelmux.specs import scaled_mm as spec

# b's elements dequantized per block of rows (fp32: 4 MiB). 2-core x86_64 VM, best of 5, ms for DeepSeek-V3
# M 1 / M 64 x 7168 x 2048, Llama-3 M 1 per-token and DeepSeek-V3 M 1024 x 2048 x 7168: 2^18 12.4 / 31.4 / 11.4 /
# 227.3; 2^20 8.6 / 29.6 / 8.0 / 217.6; 2^22 14.5 / 27.5 / 15.1 / 190.4; 2^24 28.0 / 49.7 / 35.4 / 246.0.
BLOCK_ELEMENTS = 1 << 20


def _scaled(values: torch.Tensor, scale: torch.Tensor, block_rows: bool) -> torch.Tensor:
    """``values [r, K]`` (fp32, in place) times ``scale``: a number, a column ``[r, 1]``, or per 128-wide
    group of a row ``[r, ceil(K / 128)]`` (``block_rows``: per 128 x 128 block, scale ``[ceil(r / 128), .]``)."""
    rows, cols = values.shape
    if scale.dim() < 2 or scale.shape[1] == 1 and not block_rows:
        return values.mul_(scale)
    if block_rows:
        scale = scale.repeat_interleave(spec.BLOCK, dim=0)[:rows]
    if cols % spec.BLOCK == 0:
        values.view(rows, cols // spec.BLOCK, spec.BLOCK).mul_(scale[:, :, None])
        return values
    return values.mul_(scale.repeat_interleave(spec.BLOCK, dim=1)[:, :cols])


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor, block_rows: bool) -> torch.Tensor:
    """fp8 ``codes [r, K]`` times their scales, in fp32, each product rounded once."""
    route = ROUTE_SCALES[codes.dtype]
    return _scaled(fp8_as_half(codes, scratch).float(), scale * route, block_rows)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm; arguments are validated by the caller."""
    rows, cols = a.shape
    channels = b.shape[0]
    layout = spec.validated_scaling(scale_a, scale_b, channels)
    sa, sb = scale_a.float(), scale_b.float()
    if layout == "tensor":
        sa, sb = sa.reshape(()), sb.reshape(())
    out = torch.empty((rows, channels), dtype=torch.float32)
    if rows and channels:
        scratch = torch.empty(max(a.numel(), min(b.numel(), BLOCK_ELEMENTS + spec.BLOCK * cols)), dtype=torch.int16)
        deq_a = _dequantized(a, sa, scratch, block_rows=False)
        # Blocks of whole 128-row weight blocks, so a block's scale row is its own.
        step = max(1, BLOCK_ELEMENTS // (cols * spec.BLOCK)) * spec.BLOCK
        for start in range(0, channels, step):
            stop = min(channels, start + step)
            block_scale = sb[start // spec.BLOCK:-(-stop // spec.BLOCK)] if layout == "block" else (
                sb[start:stop] if layout == "channel" else sb)
            deq_b = _dequantized(b[start:stop], block_scale, scratch, block_rows=layout == "block")
            out[:, start:stop] = deq_a @ deq_b.T
    if bias is not None:
        out += bias.float()
    return out.to(spec.OUT_DTYPES[out_dtype])
