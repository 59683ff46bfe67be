"""The Triton kernel behind the triton backend's kv_cache_write: each program scatters a few tokens'
[Hkv, D] key and value rows into their paged-cache slots, copying or quantizing to fp8 (the host
side is kv_cache_write.py)."""

import triton
import triton.language as tl

# fp8 (float8_e4m3fn) codes, and why there are two routes to them:
#
# The reference is quantize_to_cache_fp8: fp32 x / scale (a correctly rounded division), clamped
# to +-448 (NaN stays NaN), cast with round-to-nearest-even. c10's cast writes a NaN as 0x7F with
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
# fp32 bit patterns: 2**-6 (the smallest normal e4m3fn), 2**23 (the rounding magic) and +inf.
_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)
_MAGIC_BITS = tl.constexpr(0x4B000000)
_INF_BITS = tl.constexpr(0x7F800000)
# e4m3fn's exponent bias is 7, fp32's 127: a normal fp32 exponent e becomes e - 120, which is
# 120 << 3 = 960 once the fp32 bits are shifted down to sign-less e4m3 bits (exponent, 3 mantissa).
_REBIAS = tl.constexpr(960)


@triton.jit
def _e4m3fn_codes(x, nan_sign, NATIVE_FP8: tl.constexpr):
    """fp32 (already divided by the scale) -> float8_e4m3fn codes (uint8): saturated to +-448,
    rounded to nearest even; NaN -> 0x7F | nan_sign (int32, 0 or 0x80 per element)."""
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
    return code.to(tl.uint8)


@triton.jit
def _write_rows(
    src_ptr,
    dst_ptr,
    src_row,  # [BLOCK_T] int64: each token's row offset in the source
    dst_row,  # [BLOCK_T] int64: each token's slot offset in the cache
    heads,  # [BLOCK_H] int64
    dims,  # [BLOCK_D] int64
    stride_h,
    stride_d,
    cache_stride_h,
    cache_stride_d,
    mask,  # [BLOCK_T, BLOCK_H, BLOCK_D], or [BLOCK_T, 1, 1] when the tile has no padding lanes
    scale_ptr,
    FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    src = src_row[:, None, None] + (heads[:, None] * stride_h + dims[None, :] * stride_d)[None, :, :]
    dst = dst_row[:, None, None] + (
        heads[:, None] * cache_stride_h + dims[None, :] * cache_stride_d
    )[None, :, :]
    # Padding tokens and padding lanes are neither read nor written.
    rows = tl.load(src_ptr + src, mask=mask)
    if FP8:
        x = rows.to(tl.float32)
        if HAS_SCALE:
            # One scale load per program (L1/L2-hot after the first); read on the device, so no
            # host sync and a CUDA graph replays with the scale's current value.
            scale = tl.load(scale_ptr)
            x = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
        if HAS_SCALE or rows.dtype != tl.bfloat16:
            nan_sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        else:
            nan_sign = tl.where(rows.to(tl.int16, bitcast=True) < 0, 0x80, 0)
        tl.store(dst_ptr + dst, _e4m3fn_codes(x, nan_sign, NATIVE_FP8), mask=mask)
    else:
        # Same dtype (the host passes int16 views): a bit copy, NaN payloads included.
        tl.store(dst_ptr + dst, rows, mask=mask)


@triton.jit
def kv_cache_write_kernel(
    key_ptr,  # [T, Hkv, D] any strides; int16 view (copy) or bf16/fp16 (FP8)
    value_ptr,  # like key
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] any strides; int16 view, or uint8 view (FP8)
    v_cache_ptr,  # like k_cache
    slot_ptr,  # [T] int64, contiguous; negative = padding token (skipped)
    k_scale_ptr,  # fp32, one element; any valid pointer when HAS_K_SCALE is False (never read)
    v_scale_ptr,  # likewise
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,  # Hkv
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per tile (a power of two); the program loops over head chunks
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    FP8: tl.constexpr,  # the caches are float8_e4m3fn (else the dtype of key)
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,  # fp8 codes through the hardware cast (see _e4m3fn_codes)
):
    # Every offset is int64: slot * stride passes 2**31 in caches over 2 G elements (a 16 GiB
    # bf16 cache), and a head stride can be large in a permuted view. Per-token offsets are a few
    # scalars per program and the tile's are computed once per head chunk, so this costs nothing.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1)
    write = slots >= 0  # rows past T read -1, so they are skipped like padding tokens
    slots = tl.where(write, slots, 0)
    block = slots // block_size
    offset = slots - block * block_size
    k_dst = block * stride_kcb + offset * stride_kcs
    v_dst = block * stride_vcb + offset * stride_vcs
    k_src = tokens * stride_kt
    v_src = tokens * stride_vt

    # Padding lanes exist only when Hkv or D is not a multiple of the tile; otherwise the mask is
    # per token, constant along the row, which keeps the accesses 16-byte vectors.
    LANES_PADDED: tl.constexpr = (NUM_HEADS % BLOCK_H != 0) or (HEAD_DIM != BLOCK_D)
    head_lanes = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + head_lanes
        if LANES_PADDED:
            lane_ok = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
            mask = write[:, None, None] & lane_ok[None, :, :]
        else:
            mask = write[:, None, None]
        _write_rows(key_ptr, k_cache_ptr, k_src, k_dst, heads, dims, stride_kh, stride_kd,
                    stride_kch, stride_kcd, mask, k_scale_ptr, FP8, HAS_K_SCALE, NATIVE_FP8)
        _write_rows(value_ptr, v_cache_ptr, v_src, v_dst, heads, dims, stride_vh, stride_vd,
                    stride_vch, stride_vcd, mask, v_scale_ptr, FP8, HAS_V_SCALE, NATIVE_FP8)
