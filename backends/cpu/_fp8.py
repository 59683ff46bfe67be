"""Fast exact float8 e4m3 (fn and fnuz) -> fp16/bf16 conversion for CPU tensors, shared by the cpu
backend's paged_attention, mla_decode and fused_moe."""

# torch converts e4m3fn on the CPU one element at a time: ~2.4 ns per element against ~0.4 ns for
# the route below on a 2-core AVX-512 VM, perf/decisions/paged_attention.md. The route uses integer
# ops, which are vectorized: an e4m3fn byte ``s eeee mmm`` moved to bits 15 and 13..7 of an int16
# is the fp16 number ``s 0eeee mmm0000000``, whose value is the fp8 value times ``2^-8`` for every
# code, subnormals included (both formats' subnormals have exponent field 0 and the same
# exponent-bias difference, 15 - 7 = 8). Callers fold the ``2^8`` into a scale.
#
# Only the NaN codes (``s 1111 111``) come out wrong, as +-1.875 (fp16) where every finite code
# gives at most 448 * 2^-8 = 1.75 in magnitude, so one min/max pass detects them and only then a
# mask pass restores NaN.
#
# e4m3fnuz (AMD gfx942) has exponent bias 8, one less than e4m3fn's: the same bits are half the
# e4m3fn value, so the route gives its value times 2^-7, the codes 0x7f/0xff included (+-240, its
# largest). Its only NaN is 0x80 (e4m3fn's -0.0), which the route turns into -0.0: one min pass
# over the bytes (-128 is the smallest int8) detects it.

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# The route yields value * 2^-8 (e4m3fn) or value * 2^-7 (e4m3fnuz): multiply results (or scales)
# by this.
FP8_ROUTE_SCALE = 256.0
ROUTE_SCALES = {torch.float8_e4m3fn: FP8_ROUTE_SCALE, torch.float8_e4m3fnuz: 128.0}
_LARGEST_FINITE = 448.0 / FP8_ROUTE_SCALE
_KEEP_SIGN_AND_LOW_SEVEN = -16512  # 0xBF80 as int16: bit 15 and bits 13..7
_NAN_PATTERN = 0x3F80  # the e4m3fn NaN codes' bits 13..7, all ones
_FNUZ_NAN_BYTE = -128  # 0x80 as int8
_FNUZ_NAN_BITS = -32768  # 0x80 after the route: bit 15 alone


def fp8_as_half(codes: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``codes`` (float8_e4m3fn or float8_e4m3fnuz, any strides) divided by ``ROUTE_SCALES[dtype]``
    as fp16, exactly, NaN codes as NaN, in ``scratch``'s memory (an int16 tensor of at least the
    same numel; its first numel elements are overwritten). Returns fp16 of ``codes.shape``."""
    bits = scratch.view(-1)[: codes.numel()].view(codes.shape)
    if codes.numel() == 0:
        return bits.view(torch.float16)
    # Sign-extend the byte, then shift: the sign lands in bit 15 (and bit 14, cleared by the mask).
    # The shift is a multiply by 2^7 (-128 * 128 = -16384 fits int16), ~30% faster than
    # bitwise_left_shift_ (50 against 71 us for 917K elements, perf/decisions/fused_moe.md).
    bits.copy_(codes.view(torch.int8)).mul_(128).bitwise_and_(_KEEP_SIGN_AND_LOW_SEVEN)
    half = bits.view(torch.float16)
    if codes.dtype == torch.float8_e4m3fnuz:
        if codes.view(torch.int8).min() == _FNUZ_NAN_BYTE:
            half.masked_fill_(bits == _FNUZ_NAN_BITS, float("nan"))
        return half
    low, high = torch.aminmax(half)
    if high > _LARGEST_FINITE or low < -_LARGEST_FINITE:
        half.masked_fill_(bits.bitwise_and(_NAN_PATTERN) == _NAN_PATTERN, float("nan"))
    return half


def fp8_to_half_scaled(codes: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Write ``codes`` (float8_e4m3fn) times ``2^-8`` into ``out`` (fp16 or bf16, same numel),
    exactly, NaN codes as NaN. ``scratch``: an int16 tensor of the same numel. Returns ``out``
    viewed as ``codes.shape``."""
    half = fp8_as_half(codes, scratch)
    if codes.numel() == 0:
        return out.view(codes.shape)
    if out.dtype == torch.float16:
        return out.view(codes.shape).copy_(half)
    # fp16 -> bf16 directly is an unvectorized path (1.85 ms per 4M elements); through fp32 it
    # is two vectorized passes (0.9 ms). Both are exact here: 3-bit mantissas, small exponents.
    return out.view(codes.shape).copy_(half.float())
