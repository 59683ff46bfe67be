"""fp4 (e2m1) codes and their scales in Triton kernels, from and to fp32 bits: the one encoder and decoder
of the triton backend (quantize_nvfp4's and quantize_mxfp4's kernels encode, fused_moe's W4A16 mainloops
decode). Integer and exact fp32 operations only, so the interpreter computes the same bits as the GPU."""

import triton
import triton.language as tl

E2M1_MAX = tl.constexpr(6.0)
_ONE_BITS = tl.constexpr(0x3F800000)
_MAGIC_BITS = tl.constexpr(0x4B000000)  # 2^23


@triton.jit
def e2m1_codes(v):
    """fp32 -> e2m1 codes (int32 0..15; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6): rounded half to even, saturated
    at +-6, the sign bit that of ``v`` (a negative value rounding to zero gives 8). From the bits, as fp32
    rounding itself works: |v| >= 1 keeps one mantissa bit (add just under half an ulp of it, plus one when
    the kept bit is odd: ties go to even; a carry moves into the exponent, 1.75 -> 2), so the code is
    2 (exponent - 126) + that bit; below 1 the code is 2|v| rounded to nearest even by an fp32 add of 2^23
    (2|v| is exact), 0, 1 or 2. NaN saturates to 6 (callers mask such blocks)."""
    m = tl.abs(v)
    m = tl.where(m < E2M1_MAX, m, E2M1_MAX)  # NaN compares false: 6 here and on the GPU alike
    bits = m.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    small = (m * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - _MAGIC_BITS
    code = tl.where(bits >= _ONE_BITS, normal, small)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_values(codes):
    """int32 e2m1 codes 0..15 -> fp32 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (8: -0.0),
    exactly, in five integer operations and a conversion: code bits s e1 e0 m placed as fp16's sign, two
    low exponent bits and first mantissa bit are the value times 2^-14, subnormal 0.5 included (the
    fp16 -> fp32 conversion keeps fp16 subnormals; fp32 subnormals might be flushed)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_values(codes):
    """e8m0 scale codes (any integer type) -> fp32 2^(code - 127), exactly (0: 2^-127, a subnormal; 0xFF: NaN)."""
    c = codes.to(tl.int32)
    scale = tl.where(c == 0, 1 << 22, c << 23).to(tl.float32, bitcast=True)
    return tl.where(c == 255, float("nan"), scale)


@triton.jit
def e4m3fn_values(codes):
    """float8_e4m3fn bits (any integer type) -> fp32, exactly: 2^(e - 7) (1 + m / 8), subnormal m 2^-9, 0x7F
    and 0xFF NaN, the sign bit kept (0x80: -0.0)."""
    c = codes.to(tl.int32)
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # 2^-9
    value = tl.where((c & 0x7F) == 0x7F, float("nan"), value)
    return (value.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def floor_log2(x):
    """floor(log2(x)) of positive finite fp32 ``x`` (int32), exact, subnormals included (from the bits: a
    subnormal's mantissa converts to a normal fp32 exactly)."""
    bits = x.to(tl.int32, bitcast=True)
    biased = bits >> 23
    mantissa = bits & 0x7FFFFF
    sub = ((mantissa.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127) - 149
    return tl.where(biased > 0, biased - 127, sub)


@triton.jit
def is_power_of_two(x):
    """Whether positive finite fp32 ``x`` is an exact power of two, subnormals included."""
    bits = x.to(tl.int32, bitcast=True)
    mantissa = bits & 0x7FFFFF
    return tl.where((bits >> 23) > 0, mantissa == 0, (mantissa & (mantissa - 1)) == 0)


@triton.jit
def pack_pairs(codes, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, WIDTH] int32 codes -> [ROWS, WIDTH / 2] bytes, element 2j in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (ROWS, WIDTH // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)
