"""The triton backend's fp4_mm kernels, W4A16: bf16/fp16 activations times NVFP4 or MXFP4 weights decoded in the
mainloop (_fp4_kernel.py). A GEMV per (row of a, tile of N) for a few rows: the CUDA cores multiply, fp32
products summed over K once; else a tiled tensor-core GEMM (fp4_dot: weights decoded into the activations'
dtype, exactly). NVFP4's global scale divides the fp32 sum. Host side: fp4_mm.py."""

import torch
import triton
import triton.language as tl

from kernelmux.backends.triton._fp4_kernel import NVFP4, fp4_dot, fp4_gemv_step, gemv_sum
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
