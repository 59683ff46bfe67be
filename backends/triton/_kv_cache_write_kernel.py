"""The Triton kernel behind the triton backend's kv_cache_write: each program scatters a few tokens'
[Hkv, D] key and value rows into their paged-cache slots, copying or quantizing to fp8 (the host
side is kv_cache_write.py)."""

import triton
import triton.language as tl

from kernelmux.backends.triton._fp8_kernel import e4m3fn_codes


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
        tl.store(dst_ptr + dst, e4m3fn_codes(x, nan_sign, NATIVE_FP8), mask=mask)
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
