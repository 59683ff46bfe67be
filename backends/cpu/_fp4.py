"""NVFP4 / MXFP4 on the CPU, shared by the cpu backend's fp4 ops: packed e2m1 codes and their block scales
decoded to fp32 exactly as the specs' dequantize_fp4 computes them (bit for bit; fused_moe, fp4_mm), a GEMM
against weights decoded a chunk of rows at a time into reused buffers, and fp32 values encoded into packed
codes as the specs' encode_e2m1 and pack_nibbles do (the quantize ops)."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._gemm import padded_rows
from kernelmux.specs.fp4_mm import BLOCKS, E2M1_TABLE
from kernelmux.specs.quantize_mxfp4 import e8m0_to_float

__all__ = ["SCALE_VALUES", "decode", "decode_experts", "encode_packed", "gemm", "widened"]

# A packed byte's two values (element 2j in the low nibble), fp32 [256, 2], read as one int64 per
# byte: a 1M-weight MXFP4 chunk decodes (gather and scales) in 0.55-0.6 ms into reused buffers,
# against 1.9 ms for torch's [256, 2] row gather into new tensors and e8m0_to_float (2-core VM); a
# two-byte [65536] table or one keyed by (scale code, byte), dropping the scale pass, are no faster.
_PAIRS = torch.tensor([[E2M1_TABLE[b & 15], E2M1_TABLE[b >> 4]] for b in range(256)], dtype=torch.float32)
_PAIR_BITS = _PAIRS.view(torch.int64).view(-1)
# Block scales' fp32 value per code byte, from the reference's own conversions (e8m0_to_float; torch's
# e4m3fn cast): one small gather instead of e8m0_to_float's six passes or the fp8 cast.
_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
SCALE_VALUES = {"mxfp4": e8m0_to_float(_CODES), "nvfp4": _CODES.view(torch.float8_e4m3fn).float()}


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
    block_scale = SCALE_VALUES[fmt].index_select(0, codes_of_scales).view(rows, cols // block, 1)
    values = out.view(rows, cols // block, block).mul_(block_scale)
    if fmt == "nvfp4":  # (e2m1 * sf) / gs: the reference's order (a product by 1/gs rounds twice)
        values.div_(global_scale.float())
    return out.view(rows, cols)


# encode_packed's integer route (the triton backend's e2m1_codes, in torch passes): fp32 bits of 1.0, and of 2^23
# (the add that rounds 2|v| < 2 to an integer, half to even, in its low mantissa bits).
_ONE_BITS = 0x3F800000
_MAGIC_BITS = 0x4B000000
_E2M1_MAX = 6.0
# Its search route: the magnitude code is the count of these bounds below |v|: the midpoints between codes, each
# that ties upward (to the even code) moved one ulp down, so that the midpoint itself counts.
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_BOUNDS = torch.where(torch.tensor([False, True, False, True, False, True, False]),
                      torch.nextafter(_BOUNDS, torch.zeros(())), _BOUNDS)
# Up to this many values the search route (9 torch calls, ~4 ns a value: torch.bucketize) beats the integer
# route (21 calls, ~0.06 ns a value) on call overhead: 2-core VM, ~3 us a call.
SEARCH_MAX_VALUES = 8192


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a fresh row-major fp32 copy (the quantize ops scale it in place; ``float()`` of fp32 is ``x``)."""
    return x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def encode_packed(scaled: torch.Tensor, keep: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 ``scaled [n, blocks, block]`` -> packed codes in ``out [n, blocks * block / 2]`` uint8 (element 2j in
    the low nibble), returned: each value's e2m1 code rounded half to even, saturated at +-6, the sign bit that of
    the value (-0.0 and negatives rounding to 0 give 8); the codes of a block whose ``keep [n, blocks]`` (uint8)
    is 0 are 0. The bits of the specs' encode_e2m1 (7 comparisons, 28 passes over uint8), by a search for few
    values, else by integer passes: |v| >= 1 keeps one mantissa bit rounded half to even by an integer add (a
    carry moves into the exponent), the code 2 (exponent - 126) + that bit; below 1 the code is 2|v| rounded by
    an fp32 add of 2^23; the two are blended by a mask from the sign of bits - bits(1.0) (torch.where took 1.4 ms
    against 0.2 for 0.9M values). NaN gives an arbitrary code (callers zero its block)."""
    rows, blocks, block = scaled.shape
    magnitude = scaled.abs()
    if scaled.numel() <= SEARCH_MAX_VALUES:
        codes = torch.bucketize(magnitude, _BOUNDS, out_int32=True)
        sign = torch.bitwise_right_shift(scaled.view(torch.int32), 28)
    else:
        bits = magnitude.clamp_max_(_E2M1_MAX).view(torch.int32)
        below_one = (bits - _ONE_BITS).bitwise_right_shift_(31)  # -1 below 1.0, else 0 (bits >= 0: no overflow)
        codes = (bits >> 22).bitwise_and_(1).add_(bits).add_(0x1FFFFF).bitwise_right_shift_(22).sub_(252)
        small = magnitude.mul_(2.0).add_(8388608.0).view(torch.int32).sub_(_MAGIC_BITS)  # magnitude's memory
        codes += small.sub_(codes).bitwise_and_(below_one)
        sign = torch.bitwise_right_shift(scaled.view(torch.int32), 28, out=below_one)
    codes |= sign.bitwise_and_(8)
    pairs = codes.view(torch.int64)  # element 2j in the low half: the byte is lo | hi << 4, hi from bit 32 >> 28
    packed = (pairs | (pairs >> 28)).to(torch.uint8).view(rows, blocks, block // 2)
    torch.mul(packed, keep[..., None], out=out.view(rows, blocks, block // 2))
    return out
