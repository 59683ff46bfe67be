"""The triton backend's fp4_mm kernels, W4A16: bf16/fp16 activations times NVFP4 or MXFP4 weights decoded in the
mainloop (_fp4_kernel.py). A GEMV per (row of a, tile of N) for a few rows: the CUDA cores multiply, fp32
products summed over K once; else a tiled tensor-core GEMM (fp4_dot: weights decoded into the activations'
dtype, exactly); for many rows the weights decoded once into a dense matrix (fp4_dequantize_kernel) that the
platform's GEMM multiplies. NVFP4's global scale divides the fp32 sum. Host side: fp4_mm.py."""

import torch
import triton
import triton.language as tl

from kernelmux.backends.triton._fp4_kernel import (MXFP4, NVFP4, e2m1_values, fp4_dot, fp4_gemv_step, fp4_load,
                                                   fp4_pairs, fp4_scales, gemv_sum)
from kernelmux.backends.triton._grid_kernel import grouped_tile

DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # fp4_mm_kernel's HIDDEN: a's dtype


@triton.jit
def fp4_mm_gemv_kernel(a_ptr, b_ptr, s_ptr, gs_ptr, out_ptr, size_n, size_k,
                       stride_am, stride_ak, stride_bn, stride_bk, stride_sn, stride_sk, stride_om,
                       QUANT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] for one row m of a (program axis 0) and a tile of BLOCK_N weight rows (axis 1)."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < size_n
    w_rows = b_ptr + n[:, None].to(tl.int64) * stride_bn
    s_rows = s_ptr + n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, size_k, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_ptr + m * stride_am + k * stride_ak, mask=k < size_k, other=0.0).to(tl.float32)
        acc = fp4_gemv_step(acc, x, w_rows, s_rows, n_ok, k0, size_k, stride_bk, stride_sk, QUANT, INTERPRETED,
                            BLOCK_K)
    out = gemv_sum(acc, gs_ptr, QUANT)
    tl.store(out_ptr + m * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def fp4_mm_kernel(a_ptr, b_ptr, s_ptr, gs_ptr, out_ptr, size_m, size_n, size_k,
                  stride_am, stride_ak, stride_bn, stride_bk, stride_sn, stride_sk, stride_om,
                  QUANT: tl.constexpr, HIDDEN: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N] (grouped_tile's order: row tiles share a weight tile from L2)."""
    tile_m, tile_n = grouped_tile(tl.cdiv(size_m, BLOCK_M), size_n, BLOCK_N, GROUP_M)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < size_m
    n_ok = n < size_n
    a_rows = a_ptr + m[:, None].to(tl.int64) * stride_am
    w_rows = b_ptr + n[:, None].to(tl.int64) * stride_bn
    s_rows = s_ptr + n[:, None].to(tl.int64) * stride_sn
    DOT: tl.constexpr = tl.float32 if INTERPRETED else HIDDEN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, size_k, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & (k < size_k)[None, :], other=0.0)
        acc = fp4_dot(a, acc, w_rows, s_rows, n_ok, k0, size_k, stride_bk, stride_sk, QUANT, HIDDEN, DOT, INTERPRETED,
                      BLOCK_N, BLOCK_K)
    if QUANT == NVFP4:  # W = e2m1 sf / gs: the global scale divides the sum
        acc = tl.math.div_rn(acc, tl.broadcast_to(tl.load(gs_ptr), acc.shape))
    out = out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def divide_into_kernel(x_ptr, divisor_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """out = x / divisor[0], elementwise over numel contiguous elements (BLOCK a program): fp32 x, an IEEE division,
    one rounding into out's dtype. One pass where torch.div(x, divisor, out=) into a 16-bit out divides into an fp32
    temporary first."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, tl.div_rn(x, tl.load(divisor_ptr)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def fp4_dequantize_kernel(b_ptr, s_ptr, w_ptr, size_n, size_k, stride_bn, stride_bk, stride_sn, stride_sk, stride_wn,
                          QUANT: tl.constexpr, HIDDEN: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """w[n, k] = e2m1(q) * sf for a tile of BLOCK_N weight rows (program axis 0) by BLOCK_K of K (axis 1), NVFP4's
    global scale left to the GEMM's sum: exact in HIDDEN (fp4_pairs' decoding), in fp32 in the interpreter (whose
    bf16 arithmetic is wrong; the host's buffer is fp32 there)."""
    FP4_BLOCK: tl.constexpr = 32 if QUANT == MXFP4 else 16
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = n < size_n
    w_rows = b_ptr + n[:, None].to(tl.int64) * stride_bn
    s_rows = s_ptr + n[:, None].to(tl.int64) * stride_sn
    packed, scale_codes = fp4_load(w_rows, s_rows, n_ok, k0, size_k, stride_bk, stride_sk, QUANT, BLOCK_K)
    if INTERPRETED:
        packed = packed.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))  # k = 2j low, 2j + 1 high
        values = tl.reshape(e2m1_values(codes), (BLOCK_N, BLOCK_K // FP4_BLOCK, FP4_BLOCK))
        values = tl.reshape(values * fp4_scales(scale_codes, QUANT)[:, :, None], (BLOCK_N, BLOCK_K))
    else:
        even, odd = fp4_pairs(packed, scale_codes, QUANT, HIDDEN)
        values = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], values.to(w_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (k < size_k)[None, :])
