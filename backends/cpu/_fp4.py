"""NVFP4 / MXFP4 weights on the CPU, shared by the cpu backend's fused_moe and fp4_mm: packed e2m1 codes
and their block scales decoded to fp32 exactly as the specs' dequantize_fp4 computes them (bit for bit), and
a GEMM against weights decoded a chunk of rows at a time into reused buffers."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._gemm import padded_rows
from kernelmux.specs.fp4_mm import BLOCKS, E2M1_TABLE
from kernelmux.specs.quantize_mxfp4 import e8m0_to_float

__all__ = ["decode", "decode_experts", "gemm"]

# A packed byte's two values (element 2j in the low nibble), fp32 [256, 2], read as one int64 per
# byte: a 1M-weight MXFP4 chunk decodes (gather and scales) in 0.55-0.6 ms into reused buffers,
# against 1.9 ms for torch's [256, 2] row gather into new tensors and e8m0_to_float (2-core VM); a
# two-byte [65536] table or one keyed by (scale code, byte), dropping the scale pass, are no faster.
_PAIRS = torch.tensor([[E2M1_TABLE[b & 15], E2M1_TABLE[b >> 4]] for b in range(256)], dtype=torch.float32)
_PAIR_BITS = _PAIRS.view(torch.int64).view(-1)
# Block scales' fp32 value per code byte, from the reference's own conversions (e8m0_to_float; torch's
# e4m3fn cast): one small gather instead of e8m0_to_float's six passes or the fp8 cast.
_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_SCALE_VALUES = {"mxfp4": e8m0_to_float(_CODES), "nvfp4": _CODES.view(torch.float8_e4m3fn).float()}


def gemm(a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor],
         fmt: str, chunk_elements: int) -> torch.Tensor:
    """``a [M, K]`` fp32 @ ``W.T`` -> ``[M, N]`` fp32, where ``W`` is packed fp4 ``codes [N, K/2]`` with
    block ``scale [N, K/block]`` (and NVFP4's ``global_scale``), decoded to fp32 ``chunk_elements`` at a
    time as the reference's dequantize_fp4 computes them."""
    rows, half = codes.shape
    tokens = a.shape[0]
    a = padded_rows(a)
    step = max(1, min(rows, chunk_elements // (2 * half)))
    buffer = torch.empty(step * 2 * half, dtype=torch.float32)
    index = torch.empty(step * half, dtype=torch.int32)
    result = torch.empty((rows, a.shape[0]), dtype=torch.float32)  # transposed: chunks are rows
    for first in range(0, rows, step):
        chunk = codes[first:first + step]
        values = decode(chunk, scale[first:first + step], global_scale, fmt, buffer, index)
        torch.mm(values, a.T, out=result[first:first + chunk.shape[0]])
    return result[:, :tokens].T


def decode_experts(w: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor],
                   fmt: str) -> torch.Tensor:
    """Every expert of packed ``w [E, N, K/2]`` decoded at once: ``[E, N, K]`` fp32."""
    experts, rows, half = w.shape
    gs = global_scale.float().repeat_interleave(rows).view(-1, 1, 1) if global_scale is not None else None
    values = decode(w.reshape(-1, half), scale.reshape(experts * rows, -1), gs, fmt,
                    torch.empty(2 * w.numel(), dtype=torch.float32), torch.empty(w.numel(), dtype=torch.int32))
    return values.view(experts, rows, 2 * half)


def decode(codes: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], fmt: str,
           buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Packed ``codes [n, K/2]`` with block ``scale [n, K/block]`` (NVFP4: over ``global_scale``,
    one or ``[n, 1, 1]``) -> ``[n, K]`` fp32 in ``buffer``'s memory (``index``: int32 scratch of
    ``codes.numel()``), each value the reference's dequantize_fp4's: ``e2m1 * 2^(code - 127)``, or
    ``(e2m1 * sf) / gs`` in that order."""
    rows, half = codes.shape
    cols, block = 2 * half, BLOCKS[fmt]
    pairs = index[: codes.numel()].view(rows, half).copy_(codes).view(-1)
    out = buffer[: 2 * codes.numel()]
    torch.index_select(_PAIR_BITS, 0, pairs, out=out.view(torch.int64))
    codes_of_scales = scale.view(torch.uint8).reshape(-1).int()
    block_scale = _SCALE_VALUES[fmt].index_select(0, codes_of_scales).view(rows, cols // block, 1)
    values = out.view(rows, cols // block, block).mul_(block_scale)
    if fmt == "nvfp4":  # (e2m1 * sf) / gs: the reference's order (a product by 1/gs rounds twice)
        values.div_(global_scale.float())
    return out.view(rows, cols)
