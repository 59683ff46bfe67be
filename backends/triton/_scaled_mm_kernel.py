"""The triton backend's scaled_mm kernels: the fp8 GEMM ``(a * scale_a) @ (b * scale_b).T (+ bias)`` over
output tiles, each program one tile and one slice of K (split-K), and the sum of the slices. Host side:
scaled_mm.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._grid_kernel import grouped_tile

# Scale layouts (constexpr SCALING), the spec's LAYOUTS: a scalar each; a [M] x b [N] after the sum;
# a [M, K / 128] x b [N / 128, K / 128] applied to each k-step's product (a step lies in one group).
TENSOR = tl.constexpr(0)
CHANNEL = tl.constexpr(1)
BLOCK = tl.constexpr(2)
GROUP = tl.constexpr(128)  # the spec's BLOCK: a's 1 x 128 groups, b's 128 x 128 blocks


@triton.jit
def scaled_mm_kernel(
    a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, bias_ptr, out_ptr,
    rows, cols, depth, k_per_split,
    stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_bias,
    stride_os, stride_om,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[m, n] = sum_k a[m, k] b[n, k] times the scales, for a BLOCK_M x BLOCK_N tile (program axis 0,
    GROUP_M row tiles sharing a column of b in L2) over the k_per_split slice of K that program axis 1
    picks. SPLIT_K == 1: plus the bias in fp32, rounded once into out. SPLIT_K > 1: the scaled fp32
    slice sum is stored at out + slice * stride_os, for scaled_mm_sum_kernel. The interpreter multiplies
    the codes widened to fp32 (exact)."""
    tile_m, tile_n = grouped_tile(tl.cdiv(rows, BLOCK_M), cols, BLOCK_N, GROUP_M)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = n < cols
    k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + n[None, :].to(tl.int64) * stride_bn
    if SCALING == BLOCK:
        tl.static_assert(GROUP % BLOCK_K == 0)  # a k-step never straddles two scale groups
        scale_a_rows = scale_a_ptr + m * stride_sam
        scale_b_cols = scale_b_ptr + (n // GROUP) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split  # k_per_split: a multiple of BLOCK_K, >= K when SPLIT_K is 1
    for k0 in range(k_start, min(k_start + k_per_split, depth), BLOCK_K):
        k_ok = k0 + k < depth
        a = tl.load(a_rows + (k0 + k)[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + k)[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRETED:
            a, b = a.to(tl.float32), b.to(tl.float32)
        # Each step's product is added to acc by the CUDA cores, not chained through the MMA's own
        # accumulator: Hopper's fp8 MMA accumulates with fewer than fp32's bits (Triton's default on
        # sm_90 never promotes), which put Llama-3-8B's 1024 x 4096 x 4096 outside the spec's tolerance.
        if SCALING == BLOCK:
            group_a = tl.load(scale_a_rows + (k0 // GROUP) * stride_sak, mask=m_ok, other=0.0)
            block_b = tl.load(scale_b_cols + (k0 // GROUP) * stride_sbk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * (group_a[:, None] * block_b[None, :])
        else:
            acc += tl.dot(a, b)
    if SCALING == TENSOR:
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    elif SCALING == CHANNEL:
        channel_a = tl.load(scale_a_ptr + m * stride_sam, mask=m_ok, other=0.0)
        channel_b = tl.load(scale_b_ptr + n * stride_sbn, mask=n_ok, other=0.0)
        acc = acc * (channel_a[:, None] * channel_b[None, :])
    mask = m_ok[:, None] & n_ok[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :]
    if SPLIT_K > 1:
        tl.store(out + tl.program_id(1).to(tl.int64) * stride_os, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scaled_mm_sum_kernel(partials_ptr, bias_ptr, out_ptr, cols, size, stride_ps, stride_bias,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the SPLIT_K slices' fp32 partials (contiguous [rows, cols] each, stride_ps
    apart) plus the bias in fp32, rounded once; BLOCK elements of the flat [rows, cols] a program."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = index < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partials_ptr + split * stride_ps + index, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + index % cols * stride_bias, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + index, acc.to(out_ptr.dtype.element_ty), mask=ok)
