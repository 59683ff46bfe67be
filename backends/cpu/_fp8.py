"""Fast exact float8_e4m3fn -> fp16/bf16 conversion for CPU tensors, shared by the cpu backend's
paged_attention and mla_decode."""

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

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# The route yields value * 2^-8: multiply results (or scales) by this.
FP8_ROUTE_SCALE = 256.0
_LARGEST_FINITE = 448.0 / FP8_ROUTE_SCALE
_KEEP_SIGN_AND_LOW_SEVEN = -16512  # 0xBF80 as int16: bit 15 and bits 13..7
_NAN_PATTERN = 0x3F80  # the NaN codes' bits 13..7, all ones


def fp8_to_half_scaled(codes: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Write ``codes`` (float8_e4m3fn) times ``2^-8`` into ``out`` (fp16 or bf16, same numel),
    exactly, NaN codes as NaN. ``scratch``: an int16 tensor of the same numel. Returns ``out``
    viewed as ``codes.shape``."""
    if codes.numel() == 0:
        return out.view(codes.shape)
    bits = scratch.view(codes.shape)
    # Sign-extend the byte, then shift: the sign lands in bit 15 (and bit 14, cleared by the mask).
    bits.copy_(codes.view(torch.int8)).bitwise_left_shift_(7).bitwise_and_(_KEEP_SIGN_AND_LOW_SEVEN)
    half = bits.view(torch.float16)
    low, high = torch.aminmax(half)
    if high > _LARGEST_FINITE or low < -_LARGEST_FINITE:
        half.masked_fill_(bits.bitwise_and(_NAN_PATTERN) == _NAN_PATTERN, float("nan"))
    if out.dtype == torch.float16:
        return out.view(codes.shape).copy_(half)
    # fp16 -> bf16 directly is an unvectorized path (1.85 ms per 4M elements); through fp32 it
    # is two vectorized passes (0.9 ms). Both are exact here: 3-bit mantissas, small exponents.
    return out.view(codes.shape).copy_(half.float())
