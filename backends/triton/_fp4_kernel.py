"""fp4 (e2m1) codes and their scales in Triton kernels: the one encoder and decoder of the triton backend, from
and to fp32 bits (quantize_nvfp4's and quantize_mxfp4's kernels encode), and the W4A16 mainloop steps that
decode weights on the fly (fused_moe's and fp4_mm's kernels): a k-step into a tensor-core dot (fp4_dot) or a
CUDA-core GEMV (fp4_gemv_step). The codecs are integer and exact fp32 operations, so the interpreter computes
the same bits as the GPU; the GPU's decoding into 16-bit values is inline PTX."""

import triton
import triton.language as tl

# The formats (constexpr QUANT; fused_moe's quantization modes use the same codes): packed e2m1 weights with
# e8m0 scales per 32 (MXFP4), or e4m3 scales per 16 and a global scale (NVFP4).
MXFP4 = tl.constexpr(3)
NVFP4 = tl.constexpr(4)
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


@triton.jit
def fp4_scales(codes, QUANT: tl.constexpr):
    """Block scale codes (uint8; NVFP4's e4m3fn bits) of format QUANT -> fp32, exactly."""
    if QUANT == MXFP4:
        return e8m0_values(codes)
    return e4m3fn_values(codes)


# fp4_pairs' PTX: four packed bytes (one 32-bit register, pack=4) -> their low nibbles as four 16-bit values in
# $0, $1 and their high nibbles in $2, $3. prmt spreads bytes 0, 1 (then 2, 3) into the two halves of a register;
# shifts and masks then place each nibble's bits e1 e0 m at the exponent's two low bits and the mantissa's first
# (bf16: bits 8..6, fp16: 11..9) and its sign bit at bit 15. Per 8 weights: 2 prmt and 4 x (2 shifts, 2 ands, an or).
_NIBBLES_ASM = """{
.reg .b32 z, t0, t1, a, b;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shl.b32 a, t0, LO; shl.b32 b, t0, 12; and.b32 a, a, MASK; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
shl.b32 a, t1, LO; shl.b32 b, t1, 12; and.b32 a, a, MASK; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
shl.b32 a, t0, HI; shl.b32 b, t0, 8; and.b32 a, a, MASK; and.b32 b, b, 0x80008000; or.b32 $2, a, b;
shl.b32 a, t1, HI; shl.b32 b, t1, 8; and.b32 a, a, MASK; and.b32 b, b, 0x80008000; or.b32 $3, a, b;
}"""
BF16_NIBBLES_ASM = tl.constexpr(_NIBBLES_ASM.replace("LO", "6").replace("HI", "2").replace("MASK", "0x01C001C0"))
FP16_NIBBLES_ASM = tl.constexpr(_NIBBLES_ASM.replace("LO", "9").replace("HI", "5").replace("MASK", "0x0E000E00"))


@triton.jit
def fp4_pairs(packed, scale_codes, QUANT: tl.constexpr, HIDDEN: tl.constexpr):
    """Packed e2m1 bytes [BLOCK_N, BLOCK_K / 2] and their block scale codes -> the weights at even k and at odd
    k (byte j's low and high nibble), [BLOCK_N, BLOCK_K / 2] each in HIDDEN, exactly, on the GPU (inline PTX):
    a nibble's bits s e1 e0 m placed as HIDDEN's sign, two low exponent bits and first mantissa bit are the
    value times 2^-126 (bf16) or 2^-14 (fp16), subnormal 0.5 included; then times 2^126 (2^14) and the scale
    in HIDDEN, packed multiplies, both exact (an e8m0 scale is a bf16 value, an e4m3 one fits either). Not
    for MXFP4 with fp16 (e8m0 leaves fp16's range). ~6 SASS instructions a weight in the k-loop against 11.5
    for e2m1_values' fp32 route and 8.6 for tl.dot_scaled (perf/decisions/fused_moe.md)."""
    FP4_BLOCK: tl.constexpr = 32 if QUANT == MXFP4 else 16
    rows: tl.constexpr = packed.shape[0]
    blocks: tl.constexpr = scale_codes.shape[1]
    if HIDDEN == tl.bfloat16:
        even, odd = tl.inline_asm_elementwise(asm=BF16_NIBBLES_ASM, constraints="=r,=r,=r,=r,r", args=[packed],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        BIAS: tl.constexpr = 2.0**126
    else:
        even, odd = tl.inline_asm_elementwise(asm=FP16_NIBBLES_ASM, constraints="=r,=r,=r,=r,r", args=[packed],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        BIAS: tl.constexpr = 16384.0
    bias = tl.full((rows, blocks, FP4_BLOCK // 2), BIAS, HIDDEN)
    scale = fp4_scales(scale_codes, QUANT).to(HIDDEN)[:, :, None]
    even = tl.reshape(even, (rows, blocks, FP4_BLOCK // 2)) * bias * scale
    odd = tl.reshape(odd, (rows, blocks, FP4_BLOCK // 2)) * bias * scale
    return tl.reshape(even, packed.shape), tl.reshape(odd, packed.shape)


@triton.jit
def fp4_load(w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """A k-step's packed e2m1 bytes [BLOCK_N, BLOCK_K / 2] (element 2j in the low nibble) at k0 of rows ``w_rows``
    [BLOCK_N, 1], and their block scale codes [BLOCK_N, BLOCK_K / block] (rows ``s_rows``); masked ones are 0."""
    FP4_BLOCK: tl.constexpr = 32 if QUANT == MXFP4 else 16
    tl.static_assert(BLOCK_K % FP4_BLOCK == 0)
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_rows + byte[None, :] * stride_wk, mask=n_ok[:, None] & (byte < size_k // 2)[None, :],
                     other=0)
    block = k0 // FP4_BLOCK + tl.arange(0, BLOCK_K // FP4_BLOCK)
    scale_codes = tl.load(s_rows + block[None, :] * stride_sk,
                          mask=n_ok[:, None] & (block < size_k // FP4_BLOCK)[None, :], other=0)
    return packed, scale_codes


@triton.jit
def fp4_dot(a, acc, w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT: tl.constexpr,
             HIDDEN: tl.constexpr, DOT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """acc + a @ W for a k-step of fp4 weights: rows ``w_rows`` [BLOCK_N, 1] of packed e2m1 bytes (element
    2j in the low nibble) at k0..k0+BLOCK_K and their block scales (rows ``s_rows``); NVFP4's global scale
    is left to the caller. The weights are decoded in HIDDEN (fp4_pairs), even and odd k apart, and the
    activations split the same way: two dots of BLOCK_K / 2, no interleaving of the decoded halves.
    MXFP4 with fp16 activations, and every call in the interpreter (whose bf16 arithmetic is wrong: x * 2
    gives 0, and bf16 -> fp32 flushes subnormals), decode to fp32 (e2m1_values) times the scale, then to DOT."""
    FP4_BLOCK: tl.constexpr = 32 if QUANT == MXFP4 else 16
    packed, scale_codes = fp4_load(w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT, BLOCK_K)
    if INTERPRETED or (QUANT == MXFP4 and HIDDEN == tl.float16):
        packed = packed.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))  # k = 2j low, 2j + 1 high
        values = tl.reshape(e2m1_values(codes), (BLOCK_N, BLOCK_K // FP4_BLOCK, FP4_BLOCK))
        values = values * fp4_scales(scale_codes, QUANT)[:, :, None]
        return tl.dot(a.to(DOT), tl.trans(tl.reshape(values, (BLOCK_N, BLOCK_K)).to(DOT)), acc)
    even, odd = fp4_pairs(packed, scale_codes, QUANT, HIDDEN)
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))
    acc = tl.dot(a_even.to(DOT), tl.trans(even.to(DOT)), acc)
    return tl.dot(a_odd.to(DOT), tl.trans(odd.to(DOT)), acc)


FP4_UNBIAS = tl.constexpr(16384.0)  # gemv_fp4's values are the weights times 2^-14


@triton.jit
def gemv_fp4(packed, scale_codes, QUANT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Packed e2m1 bytes [BLOCK_N, BLOCK_K / 2] -> fp32 values at even and at odd k (low and high nibbles)
    times 2^-14, exactly, and the block scales [BLOCK_N, BLOCK_K / block] in fp32. On the GPU each nibble's
    bits are placed as an fp16 value (FP16_NIBBLES_ASM, whose 0.5 is an fp16 subnormal that the fp16 -> fp32
    conversion keeps); the interpreter runs e2m1_values. The scale is applied in fp32, so e8m0 needs no fp16 or
    bf16 range."""
    if INTERPRETED:
        codes = packed.to(tl.int32)
        even = e2m1_values(codes & 15) * (1.0 / FP4_UNBIAS)
        odd = e2m1_values(codes >> 4) * (1.0 / FP4_UNBIAS)
    else:
        even, odd = tl.inline_asm_elementwise(asm=FP16_NIBBLES_ASM, constraints="=r,=r,=r,=r,r", args=[packed],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return even.to(tl.float32), odd.to(tl.float32), fp4_scales(scale_codes, QUANT)


@triton.jit
def gemv_sum(acc, global_ptr, QUANT: tl.constexpr):
    """A GEMV's fp32 result per row from its elementwise products (fp4_gemv_step's, or any other QUANT's):
    summed over k, fp4's 2^-14 restored, NVFP4's global scale (at ``global_ptr``) dividing it (W = e2m1 sf / gs)."""
    out = tl.sum(acc, axis=1)
    if QUANT == MXFP4 or QUANT == NVFP4:
        out = out * FP4_UNBIAS
    if QUANT == NVFP4:
        out = tl.math.div_rn(out, tl.broadcast_to(tl.load(global_ptr), out.shape))
    return out


@triton.jit
def fp4_gemv_step(acc, x, w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT: tl.constexpr,
                  INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 2] + a k-step of fp4 weights (rows ``w_rows`` [BLOCK_N, 1] of packed bytes, block
    scales in rows ``s_rows``) times ``x`` [BLOCK_K] (fp32) on the CUDA cores: each even and odd k's products
    added, times their block's scale and 2^-14 (gemv_sum restores it after the sum over k)."""
    FP4_BLOCK: tl.constexpr = 32 if QUANT == MXFP4 else 16
    rows: tl.constexpr = acc.shape[0]
    packed, scale_codes = fp4_load(w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT, BLOCK_K)
    even, odd, scale = gemv_fp4(packed, scale_codes, QUANT, INTERPRETED)
    x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
    products = tl.reshape(even * x_even[None, :] + odd * x_odd[None, :], (rows, BLOCK_K // FP4_BLOCK, FP4_BLOCK // 2))
    return acc + tl.reshape(products * scale[:, :, None], (rows, BLOCK_K // 2))
