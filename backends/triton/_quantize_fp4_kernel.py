"""The triton backend's fp4 quantization kernels: quantize_nvfp4 (blocks of 16 with e4m3fn scales under one fp32
global scale, passed in or dynamic) and quantize_mxfp4 (blocks of 32 with e8m0 scales, OCP's floor or the ceil
rule). A program quantizes ROWS rows by BLOCK_K columns (whole blocks) into packed codes and block scales in the
canonical linear layout or the 128x4 swizzled one (SWIZZLED: the host zeroes its padding); NVFP4's dynamic global
scale comes from the program's own reading of every row (a few rows) or quantize_fp8's amax pass (a first launch,
its atomic max in one fp32). Every step is the spec's correctly rounded fp32 operation or exact integer arithmetic
(_fp4_kernel.py), so the bits match the reference. Host side: quantize_nvfp4.py, quantize_mxfp4.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._fp4_kernel import (E2M1_MAX, e2m1_codes, e4m3fn_values, floor_log2,
                                                    is_power_of_two, pack_pairs)
from kernelmux.backends.triton._fp8_kernel import e4m3fn_codes

GLOBAL_NUMERATOR = tl.constexpr(2688.0)  # 448 * 6: the dynamic gs = 2688 / amax(x)
NVFP4_BLOCK = tl.constexpr(16)
MXFP4_BLOCK = tl.constexpr(32)
E8M0_BIAS = tl.constexpr(127)
# Where quantize_nvfp4_kernel's global scale comes from (constexpr GS): passed in, the program's reading of
# every row (at most TILE_ROWS), or the amax that quantize_fp8's amax_partials_kernel left in one fp32 (atomic).
GIVEN = tl.constexpr(0)
TILE = tl.constexpr(1)
AMAX = tl.constexpr(2)


@triton.jit
def _load(x_ptr, row, rows, k0, cols, stride_xm, stride_xk, BLOCK_K: tl.constexpr):
    """The [ROWS, BLOCK_K] fp32 tile of x at (row, k0); masked elements are 0."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (row < rows)[:, None] & (k < cols)[None, :]
    return tl.load(x_ptr + row[:, None].to(tl.int64) * stride_xm + k[None, :] * stride_xk, mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _store(q_ptr, s_ptr, codes, scale_codes, row, rows, k0, cols, stride_qm, stride_sm, ROWS: tl.constexpr,
           BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, SWIZZLED: tl.constexpr):
    """Packed codes [ROWS, BLOCK_K / 2] and scale bytes [ROWS, BLOCK_K / BLOCK] of the tile at (row, k0); the
    scales' row pitch stride_sm (swizzled: the padded column count)."""
    row_ok = (row < rows)[:, None]
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + row[:, None].to(tl.int64) * stride_qm + byte[None, :], pack_pairs(codes, ROWS, BLOCK_K),
             mask=row_ok & (byte < cols // 2)[None, :])
    block = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
    r = row[:, None].to(tl.int64)
    if SWIZZLED:  # (r // 128, c // 4, r % 32, r % 128 // 32, c % 4): 512-byte 128 x 4 tiles
        c = block[None, :]
        offsets = (r // 128) * (stride_sm * 128) + (c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    else:
        offsets = r * stride_sm + block[None, :]
    tl.store(s_ptr + offsets, scale_codes, mask=row_ok & (block < cols // BLOCK)[None, :])


@triton.jit
def quantize_nvfp4_kernel(x_ptr, q_ptr, sf_ptr, gs_in_ptr, gs_out_ptr, amax_ptr, rows, cols,
                          stride_xm, stride_xk, stride_qm, stride_sm,
                          GS: tl.constexpr, NATIVE_FP8: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                          TILE_ROWS: tl.constexpr, SWIZZLED: tl.constexpr):
    """NVFP4 codes and e4m3fn block scales of ROWS rows (axis 0) by BLOCK_K columns (axis 1), in the spec's
    order: sf = e4m3fn(min((gs * amax_block) / 6, 448)), r = gs / sf, codes e2m1(x * r) (0 where sf is 0).
    The first program stores the global scale."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    if GS == GIVEN:
        gs = tl.load(gs_in_ptr)
    else:
        if GS == AMAX:
            amax = tl.load(amax_ptr)
        else:  # every row is this program's to read (rows <= TILE_ROWS)
            amax = tl.zeros((TILE_ROWS,), dtype=tl.float32)
            for c0 in range(0, cols, BLOCK_K):
                tile = _load(x_ptr, tl.arange(0, TILE_ROWS), rows, c0, cols, stride_xm, stride_xk, BLOCK_K)
                amax = tl.maximum(amax, tl.max(tl.abs(tile), axis=1))
            amax = tl.max(amax, axis=0)
        gs = tl.where(amax > 0, tl.math.div_rn(GLOBAL_NUMERATOR + tl.zeros_like(amax), amax), 1.0)
    lane = tl.arange(0, ROWS)  # lane 0 of program (0, 0) stores gs (a vector mask: the interpreter's kind)
    tl.store(gs_out_ptr + lane, gs + tl.zeros((ROWS,), dtype=tl.float32),
             mask=lane + tl.program_id(0) + tl.program_id(1) == 0)
    blocks = tl.reshape(_load(x_ptr, row, rows, k0, cols, stride_xm, stride_xk, BLOCK_K),
                        (ROWS, BLOCK_K // NVFP4_BLOCK, NVFP4_BLOCK))
    block_amax = tl.max(tl.abs(blocks), axis=2)
    six = tl.full(block_amax.shape, E2M1_MAX, tl.float32)
    scaled = tl.math.div_rn(gs * block_amax, six)
    sf_codes = e4m3fn_codes(scaled, 0, NATIVE_FP8)  # saturates at 448: the spec's min
    sf = e4m3fn_values(sf_codes)
    ratio = tl.math.div_rn(gs + tl.zeros_like(sf), sf)  # inf where sf is 0: those blocks are masked
    codes = e2m1_codes(blocks * ratio[:, :, None])
    codes = tl.where((sf == 0)[:, :, None], 0, codes)
    _store(q_ptr, sf_ptr, tl.reshape(codes, (ROWS, BLOCK_K)), sf_codes, row, rows, k0, cols, stride_qm, stride_sm,
           ROWS, BLOCK_K, NVFP4_BLOCK, SWIZZLED)


@triton.jit
def quantize_mxfp4_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_xm, stride_xk, stride_qm, stride_sm,
                          CEIL: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLED: tl.constexpr):
    """MXFP4 codes and e8m0 scales of ROWS rows (axis 0) by BLOCK_K columns (axis 1): X = 2^e from the block's
    finite amax (floor: floor(log2 amax) - 2; ceil: ceil(log2(amax / 6))), e clamped to [-127, 127], codes
    e2m1(x / X) as x * 2^-e (exact: both are the correctly rounded x 2^-e). An all-zero block gets scale
    code 0 and codes 0, a block holding a NaN or an Inf scale code 0xFF and codes 0."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    blocks = tl.reshape(_load(x_ptr, row, rows, k0, cols, stride_xm, stride_xk, BLOCK_K),
                        (ROWS, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK))
    magnitude = tl.abs(blocks)
    finite = magnitude < float("inf")  # false for NaN too
    nonfinite = tl.max((~finite).to(tl.int32), axis=2) > 0
    block_amax = tl.max(tl.where(finite, magnitude, 0.0), axis=2)
    zero = block_amax == 0
    amax = tl.where(zero, 1.0, block_amax)  # keeps the bit tricks on positive values; masked below
    if CEIL:
        d = tl.math.div_rn(amax, tl.full(amax.shape, E2M1_MAX, tl.float32))
        positive = tl.where(d > 0, d, 1.0)
        e = floor_log2(positive) + tl.where(is_power_of_two(positive), 0, 1)
        e = tl.where(d > 0, e, 0)  # a d that underflows to 0: frexp's exponent 0, as the reference takes
    else:
        e = floor_log2(amax) - 2  # e2m1's largest power of two is 2^2
    e = tl.minimum(tl.maximum(e, -127), 127)
    scale_codes = tl.where(nonfinite, 255, tl.where(zero, 0, e + E8M0_BIAS))
    # 2^-e from its bits: normal for e <= 126, the subnormal 2^-127 for e = 127.
    inverse = tl.where(e >= 127, 1 << 22, (E8M0_BIAS - e) << 23).to(tl.float32, bitcast=True)
    codes = e2m1_codes(blocks * inverse[:, :, None])
    codes = tl.where((zero | nonfinite)[:, :, None], 0, codes)
    _store(q_ptr, s_ptr, tl.reshape(codes, (ROWS, BLOCK_K)), scale_codes.to(tl.uint8), row, rows, k0, cols,
           stride_qm, stride_sm, ROWS, BLOCK_K, MXFP4_BLOCK, SWIZZLED)
