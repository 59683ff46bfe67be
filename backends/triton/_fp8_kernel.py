"""fp8 codes from fp32 in Triton kernels, as torch's round-to-nearest-even saturating cast makes them:
the one fp8 conversion every kernel of the triton backend uses (kv_cache_write's cache writes,
fused_moe's dynamic activation quantization, quantize_fp8), float8_e4m3fn and, for quantize_fp8,
float8_e4m3fnuz (gfx942's). Host side: _host.native_fp8_cast."""

import triton
import triton.language as tl

# fp8 (float8_e4m3fn) codes, and why there are two routes to them:
#
# The reference is quantize_to_cache_fp8 (and quantize_fp8, the same arithmetic): fp32 x / scale (a
# correctly rounded division), clamped to +-448 (NaN stays NaN), cast with round-to-nearest-even. c10's cast writes a NaN as 0x7F with
# the NaN's sign bit (0xFF for a negative NaN), and check_close compares bytes, so that is the code
# both routes write for NaN. Which sign: that of the fp32 value the reference casts, which depends
# on how the device widens and divides. torch widens bf16 by shifting bits (the sign survives
# everywhere) but the GPU's cvt.f32.bf16, which Triton emits, returns the canonical positive NaN:
# for bf16 without a scale the kernel takes the sign from the input's bits. fp16 torch widens with
# the same hardware conversion Triton uses (on the GPU both give the canonical NaN), and with a
# scale the sign is whatever the device's division gives a NaN, in the kernel as in the reference.
#
# * NATIVE_FP8 (the host sets it for CUDA devices of compute capability >= 8.9): Triton's
#   fp32 -> fp8e4nv cast, which Triton 3.9 lowers to cvt.rn.satfinite.e4m3x2.f32 (seen in
#   libtriton's PTX templates): round-to-nearest-even, saturating. The explicit clamp before it
#   makes the saturation not depend on .satfinite, and NaN lanes are rewritten afterwards so the
#   NaN code's sign does not depend on what cvt does with one. Verified only on the GPU (the
#   kernel tests run both routes there, bit-exact against the reference).
# * the integer route (every other case: the interpreter, sm_80, ROCm, XPU): the code is built
#   from the fp32 bits, exactly as the cast defines it. The Triton 3.9 interpreter's own fp8 cast
#   (runtime/interpreter.py, _convert_float) is not usable: it rounds half-up on one cut-off bit
#   with no carry into the exponent (127.97 -> 0x68 = 64 instead of 0x70 = 128), turns fp32
#   subnormals into non-zero codes and does not saturate: 27958 of the 65536 bf16 bit patterns
#   come out wrong against torch (checked 2026-11-22), with or without fp_downcast_rounding="rtne".
#   Cost on the GPU: ~12 integer ops an element against one cvt for two elements; at ~3 bytes
#   moved per element an H100's integer pipes (~15 Tops/s) would then be the bound, not its
#   3 TB/s (an estimate, not a measurement), hence the native route where it exists. Both
#   routes run in the kernel tests on the GPU.
#
# The division is tl.math.div_rn (div.rn.f32, correctly rounded): a plain fp32 `/` promises no
# rounding in Triton (tl.math.fdiv's ieee_rounding defaults to False; earlier versions emitted the
# approximate div.full.f32, up to 2 ulp), and one ulp moves a value across an e4m3 boundary.

FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
FNUZ_MAX = tl.constexpr(240.0)  # largest finite float8_e4m3fnuz
# fp32 bit patterns: 2**-6 (the smallest normal e4m3fn), 2**23 (the rounding magic) and +inf.
_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)
_MAGIC_BITS = tl.constexpr(0x4B000000)
_INF_BITS = tl.constexpr(0x7F800000)
# e4m3fn's exponent bias is 7, fp32's 127: a normal fp32 exponent e becomes e - 120, which is
# 120 << 3 = 960 once the fp32 bits are shifted down to sign-less e4m3 bits (exponent, 3 mantissa).
_REBIAS = tl.constexpr(960)
# e4m3fnuz: exponent bias 8, so its smallest normal is 2**-7 and its rebias 119 << 3; 0x80 is its one NaN.
_FNUZ_MIN_NORMAL_BITS = tl.constexpr(0x3C000000)
_FNUZ_REBIAS = tl.constexpr(952)


@triton.jit
def e4m3fn_codes(x, nan_sign, NATIVE_FP8: tl.constexpr, IN_RANGE: tl.constexpr = False):
    """fp32 (already divided by the scale) -> float8_e4m3fn codes (uint8): saturated to +-448,
    rounded to nearest even; NaN -> 0x7F | nan_sign (int32, 0 or 0x80 per element). IN_RANGE (no NaN
    in x and |x| within an ulp of 448 at most, as quantize_fp8's quotients are) with NATIVE_FP8: the
    hardware cast alone, which rounds such values as the clamped route does (448 + an ulp to 448)."""
    if NATIVE_FP8 and IN_RANGE:  # if/else, not an early return: Triton would build the rest too
        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        # Comparisons with NaN are false, so NaN passes this clamp; tl.minimum / tl.maximum would not
        # do on the GPU (max.f32 returns the operand that is not NaN).
        x = tl.where(x > FP8_MAX, FP8_MAX, x)
        x = tl.where(x < -FP8_MAX, -FP8_MAX, x)
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80  # fp32 bit 31 -> code bit 7
        mag = bits & 0x7FFFFFFF
        if NATIVE_FP8:
            code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            # Normal codes: round the 23-bit mantissa to 3 bits (add just under half an ulp of the
            # result, plus one when the kept lsb is odd: ties go to even); a carry out of the mantissa
            # moves into the exponent, as it must (1.9375 -> 2.0). |x| <= 448 here, so no overflow
            # (NaN lanes wrap, harmlessly: they are replaced below).
            normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - _REBIAS
            # Subnormal codes (|x| < 2**-6): the code is |x| / 2**-9 rounded to nearest even, which an
            # fp32 add of 2**23 does (RNE at unit precision); |x| * 512 is exact, so an FMA contraction
            # gives the same bits. A result of 8 is 2**-6, the smallest normal code: also right.
            scaled = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
            subnormal = scaled.to(tl.int32, bitcast=True) - _MAGIC_BITS
            code = sign | tl.where(mag < _MIN_NORMAL_BITS, subnormal, normal)
        code = tl.where(mag > _INF_BITS, nan_sign | 0x7F, code)
        code = code.to(tl.uint8)
    return code


@triton.jit
def e4m3fnuz_codes(x):
    """fp32 (already divided by the scale) -> float8_e4m3fnuz codes (uint8), as torch's cast makes
    them: saturated to +-240, rounded to nearest even, NaN -> 0x80, and no negative zero (0x80 is the
    NaN: a value that rounds to 0 gets 0x00 whatever its sign). The integer route only: no hardware
    converts to this format on NVIDIA, and on gfx942 (its home) the kernels take the integer route."""
    x = tl.where(x > FNUZ_MAX, FNUZ_MAX, x)  # NaN passes, as in e4m3fn_codes
    x = tl.where(x < -FNUZ_MAX, -FNUZ_MAX, x)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # e4m3fn_codes' integer rounding, one exponent lower: normal codes from the rounded mantissa,
    # subnormal ones (|x| < 2**-7) as |x| / 2**-10 rounded to nearest even by the 2**23 add.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - _FNUZ_REBIAS
    scaled = mag.to(tl.float32, bitcast=True) * 1024.0 + 8388608.0
    subnormal = scaled.to(tl.int32, bitcast=True) - _MAGIC_BITS
    magnitude = tl.where(mag < _FNUZ_MIN_NORMAL_BITS, subnormal, normal)
    code = tl.where(magnitude == 0, 0, sign | magnitude)
    code = tl.where(mag > _INF_BITS, 0x80, code)
    return code.to(tl.uint8)
