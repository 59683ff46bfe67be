"""The triton backend's fused_moe kernels: the routing layout (count, lay out, scatter, or the three in
one program: every (token, slot) pair placed in its local expert's run of rows, each run padded to
whole BLOCK_M blocks, all on the device), fp8_block's input quantization, the two grouped GEMMs over
those blocks (gate-up with the gated activation in its epilogue, down with the router weight and
either the top-k sum in fp32 atomics or a per-pair store; fp4 weights dequantized in their mainloops),
the per-pair rows' sum, and the decode GEMVs (one program per pair or token and tile of columns, no
routing layout: each pair finds its expert in topk_ids). Host side: fused_moe.py."""

import torch
import triton
import triton.language as tl

from kernelmux.backends.triton._fp4_kernel import MXFP4, NVFP4, fp4_dot, fp4_gemv_step, gemv_sum
from kernelmux.backends.triton._fp8_kernel import FP8_MAX, e4m3fn_codes
from kernelmux.backends.triton._grid_kernel import grouped_tile

# Quantization modes (constexpr QUANT): weights in the hidden dtype, fp8 with one scale per expert and
# one dynamic activation scale per tensor, fp8 with 128 x 128 weight blocks and 1 x 128 activation groups,
# and W4A16: packed e2m1 weights with e8m0 scales per 32 (MXFP4), or e4m3 scales per 16 and a global
# scale per expert (NVFP4), multiplied in the hidden dtype.
NONE = tl.constexpr(0)
PER_TENSOR = tl.constexpr(1)
BLOCKWISE = tl.constexpr(2)
# MXFP4 and NVFP4: _fp4_kernel's format codes (3 and 4), imported above.
# Where the down kernel's per-pair results go (constexpr REDUCE): stored in the output (top-1), added
# into an fp32 output, or stored per pair for moe_sum_kernel.
STORE = tl.constexpr(0)  # the host's TOP1_STORE
ATOMIC = tl.constexpr(1)
PAIRS = tl.constexpr(2)
# The gate-up kernel's HIDDEN: the dtype the intermediate is rounded to (for fp8_block, before quantization).
HIDDEN_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
GROUP = tl.constexpr(128)  # fp8 block size and activation group (spec BLOCK)
GROUP_AMAX_FLOOR = tl.constexpr(1e-4)  # quantize_fp8's per_group floor
SCALE_FLOOR = tl.constexpr(2.0**-126)  # quantize_fp8's per_tensor floor


@triton.jit
def _local_expert(ids_ptr, map_ptr, pair, mask, stride_it, stride_ik, stride_map,
                  TOPK: tl.constexpr, HAS_MAP: tl.constexpr):
    """The local expert of each pair (-1: masked off, or routed to another rank)."""
    token = pair // TOPK
    slot = pair % TOPK
    expert = tl.load(ids_ptr + token.to(tl.int64) * stride_it + slot * stride_ik, mask=mask, other=-1)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert * stride_map, mask=mask & (expert >= 0), other=-1)
    return expert


@triton.jit
def _count(ids_ptr, map_ptr, counts_ptr, first, num_pairs, stride_it, stride_ik, stride_map,
           TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """counts[e] += the pairs of [first, first + BLOCK) routed to local expert e, a pair per lane."""
    pair = first + tl.arange(0, BLOCK)
    mask = pair < num_pairs
    expert = _local_expert(ids_ptr, map_ptr, pair, mask, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask & (expert >= 0))


@triton.jit
def _scatter(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, first, num_pairs, stride_it, stride_ik, stride_map,
             TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """sorted[row] = pair for a free row of the pair's expert's run, for the pairs of [first, first +
    BLOCK) (order within a run is free: every row is computed on its own)."""
    pair = first + tl.arange(0, BLOCK)
    mask = pair < num_pairs
    expert = _local_expert(ids_ptr, map_ptr, pair, mask, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
    local = mask & (expert >= 0)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=local)
    tl.store(sorted_ptr + row, pair, mask=local)


@triton.jit
def _layout(counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts, max_blocks,
            BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Each expert's first row (its run padded to whole blocks; also its scatter cursor), the padded
    row count, and each block's expert (-1 past the last used block), from the counts."""
    expert = tl.arange(0, E_PAD)
    # .cg: read at L2, where the count atomics landed (moe_route_kernel's own, in the same program).
    count = tl.load(counts_ptr + expert, mask=expert < num_experts, other=0, cache_modifier=".cg")
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(starts_ptr + expert, starts, mask=expert < num_experts)
    tl.store(cursor_ptr + expert, starts, mask=expert < num_experts)
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total)
    for first in range(0, max_blocks, CHUNK):
        block = first + tl.arange(0, CHUNK)
        row = block * BLOCK_M
        # A block's expert is the number of runs that end at or before its first row.
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, tl.where(row < total, owner, -1), mask=block < max_blocks)


@triton.jit
def moe_count_kernel(ids_ptr, map_ptr, counts_ptr, num_pairs, stride_it, stride_ik, stride_map,
                     TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """Routing in three launches (larger calls), step 1: the counts (zeroed by the host)."""
    _count(ids_ptr, map_ptr, counts_ptr, tl.program_id(0) * BLOCK, num_pairs, stride_it, stride_ik, stride_map,
           TOPK, HAS_MAP, BLOCK)


@triton.jit
def moe_layout_kernel(counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts,
                      max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Step 2, one program: the layout from the counts."""
    _layout(counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts, max_blocks,
            BLOCK_M, E_PAD, CHUNK)


@triton.jit
def moe_scatter_kernel(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, num_pairs, stride_it, stride_ik, stride_map,
                       TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """Step 3: every pair to its row."""
    _scatter(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, tl.program_id(0) * BLOCK, num_pairs, stride_it,
             stride_ik, stride_map, TOPK, HAS_MAP, BLOCK)


@triton.jit
def moe_route_kernel(ids_ptr, map_ptr, counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, sorted_ptr,
                     num_pairs, num_experts, max_blocks, stride_it, stride_ik, stride_map,
                     TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                     E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """The three steps in one program (decode sizes: one launch for a fill and three), the counts
    zeroed here; a barrier between steps orders the program's own global writes."""
    expert = tl.arange(0, E_PAD)
    tl.store(counts_ptr + expert, 0, mask=expert < num_experts)
    tl.debug_barrier()
    for first in range(0, num_pairs, BLOCK):
        _count(ids_ptr, map_ptr, counts_ptr, first, num_pairs, stride_it, stride_ik, stride_map, TOPK, HAS_MAP,
               BLOCK)
    tl.debug_barrier()
    _layout(counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts, max_blocks,
            BLOCK_M, E_PAD, CHUNK)
    tl.debug_barrier()
    for first in range(0, num_pairs, BLOCK):
        _scatter(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, first, num_pairs, stride_it, stride_ik, stride_map,
                 TOPK, HAS_MAP, BLOCK)


@triton.jit
def _rows(sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, block_m, BLOCK_M: tl.constexpr):
    """The block's expert, its rows, which of them hold a pair, and those pairs."""
    expert = tl.load(block_expert_ptr + block_m)
    run_end = tl.load(starts_ptr + expert) + tl.load(counts_ptr + expert)
    row = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = row < run_end
    pair = tl.load(sorted_ptr + row, mask=valid, other=0)
    return expert, row, valid, pair


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 -> ``dtype``, rounded to nearest even. The Triton interpreter truncates fp32 -> bf16 (and
    computes bf16 dots wrong: the kernels upcast dot operands there), so there the bits are rounded
    first and the cast only drops zeros."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _gated(gate, up, GELU: tl.constexpr, HIDDEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """act(gate) * up from fp32 sums, as the spec's dataflow: gate and up rounded to HIDDEN first, the
    activation in fp32, the product rounded to HIDDEN."""
    gate = _round(gate, HIDDEN, INTERPRETED).to(tl.float32)
    up = _round(up, HIDDEN, INTERPRETED).to(tl.float32)
    if GELU:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return _round(act * up, HIDDEN, INTERPRETED)


@triton.jit
def _fp8(x, NATIVE_FP8: tl.constexpr):
    """fp32 values already divided by their scale -> e4m3fn, saturated, rounded to nearest even."""
    return e4m3fn_codes(x, 0, NATIVE_FP8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize_groups(a, NATIVE_FP8: tl.constexpr):
    """quantize_fp8's per_group on a [rows, 128] tile (masked columns are 0): codes and row scales,
    with its IEEE divisions."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), GROUP_AMAX_FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    return _fp8(tl.math.div_rn(a, tl.broadcast_to(scale[:, None], a.shape)), NATIVE_FP8), scale


@triton.jit
def moe_quantize_kernel(x_ptr, weights_ptr, codes_ptr, scales_ptr, hidden_size,
                        stride_xm, stride_xk, stride_tw_t, stride_cm, stride_sm,
                        ON_INPUT: tl.constexpr, NATIVE_FP8: tl.constexpr, GROUPS: tl.constexpr):
    """fp8_block's expert input, quantized once (not by every column tile of gate-up): GROUPS 1 x 128
    groups of one token per program, times its router weight first when it applies on the input."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = col < hidden_size
    a = tl.load(x_ptr + token * stride_xm + col * stride_xk, mask=mask, other=0.0).to(tl.float32)
    if ON_INPUT:  # k == 1: the product is taken in fp32 and is what gets quantized
        a = a * tl.load(weights_ptr + token * stride_tw_t)
    codes, scale = _quantize_groups(a, NATIVE_FP8)
    tl.store(codes_ptr + token * stride_cm + col, codes, mask=mask)
    tl.store(scales_ptr + token * stride_sm + group, scale, mask=group * GROUP < hidden_size)


@triton.jit
def moe_gate_up_kernel(
    x_ptr, w1_ptr, w1_scale_ptr, w1_global_ptr, x_scale_ptr, weights_ptr, inter_ptr, inter_scale_ptr, amax_ptr,
    sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, total_ptr,
    hidden_size, inter_size, max_blocks,
    stride_xm, stride_xk, stride_xs, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ge,
    stride_tw_t, stride_tw_k, stride_im, stride_is,
    TOPK: tl.constexpr, ON_INPUT: tl.constexpr, GELU: tl.constexpr, QUANT: tl.constexpr, HIDDEN: tl.constexpr,
    NATIVE_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """inter[row, n] = act(x W1_gate^T)[n] * (x W1_up^T)[n] for a block's rows and a tile of n, in the
    hidden dtype HIDDEN (fp32 accumulation; gate and up rounded to it first, as the spec's dataflow).
    BLOCKWISE reads x as moe_quantize_kernel's codes and row scales (stride_xs), and stores the
    intermediate as 1 x 128 fp8 groups (BLOCK_N == 128: a tile is one group) with their scales. MXFP4 and
    NVFP4 read w1 as packed codes (stride_wk per byte) with [E, 2I, H / block] scales and multiply in the
    hidden dtype; NVFP4 divides by the expert's global scale after the sum."""
    block_m, tile_n = grouped_tile(max_blocks, inter_size, BLOCK_N, GROUP_M)
    if block_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert, row, valid, pair = _rows(sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, block_m, BLOCK_M)
    token = (pair // TOPK).to(tl.int64)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xm
    w_gate = w1_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter_size * stride_wn
    if ON_INPUT and QUANT != BLOCKWISE:  # k == 1: the pair's weight scales its input, in fp32
        router = tl.load(weights_ptr + token * stride_tw_t, mask=valid, other=0.0)
    if QUANT == PER_TENSOR:
        x_scale = tl.load(x_scale_ptr)
    if QUANT == BLOCKWISE:
        tl.static_assert(BLOCK_K == GROUP and BLOCK_N == GROUP)
        x_scale_rows = x_scale_ptr + token * stride_xs
        scale_cols = w1_scale_ptr + expert.to(tl.int64) * stride_se
    if QUANT == MXFP4 or QUANT == NVFP4:  # [BLOCK_N, 1] rows of codes and of block scales
        gate_rows = w1_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
        up_rows = gate_rows + inter_size * stride_wn
        gate_scales = w1_scale_ptr + expert.to(tl.int64) * stride_se + n[:, None].to(tl.int64) * stride_sn
        up_scales = gate_scales + inter_size * stride_sn
        DOT: tl.constexpr = tl.float32 if INTERPRETED else HIDDEN
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + k < hidden_size
        a = tl.load(x_rows + (k0 + k)[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if QUANT == MXFP4 or QUANT == NVFP4:
            if ON_INPUT:
                a = _round(a.to(tl.float32) * router[:, None], HIDDEN, INTERPRETED)
            gate = fp4_dot(a, gate, gate_rows, gate_scales, n_ok, k0, hidden_size, stride_wk, stride_sk, QUANT,
                            HIDDEN, DOT, INTERPRETED, BLOCK_N, BLOCK_K)
            up = fp4_dot(a, up, up_rows, up_scales, n_ok, k0, hidden_size, stride_wk, stride_sk, QUANT,
                          HIDDEN, DOT, INTERPRETED, BLOCK_N, BLOCK_K)
        else:
            b_mask = k_ok[:, None] & n_ok[None, :]
            b_gate = tl.load(w_gate + (k0 + k)[:, None] * stride_wk, mask=b_mask, other=0.0)
            b_up = tl.load(w_up + (k0 + k)[:, None] * stride_wk, mask=b_mask, other=0.0)
            if QUANT == NONE:
                if ON_INPUT:
                    a = _round(a.to(tl.float32) * router[:, None], HIDDEN, INTERPRETED)
                if INTERPRETED:
                    a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                gate = tl.dot(a, b_gate, gate)
                up = tl.dot(a, b_up, up)
            elif QUANT == BLOCKWISE:  # one activation group and one weight block column per step
                a_scale = tl.load(x_scale_rows + k0 // GROUP, mask=valid, other=0.0)
                scale_col = scale_cols + (k0 // GROUP) * stride_sk
                # Per row: a block of 128 rows of w1 may straddle gate and up when I % 128 != 0.
                s_gate = tl.load(scale_col + (n // GROUP) * stride_sn, mask=n_ok, other=0.0)
                s_up = tl.load(scale_col + ((inter_size + n) // GROUP) * stride_sn, mask=n_ok, other=0.0)
                if INTERPRETED:
                    a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                gate += tl.dot(a, b_gate) * (a_scale[:, None] * s_gate[None, :])
                up += tl.dot(a, b_up) * (a_scale[:, None] * s_up[None, :])
            else:
                a = a.to(tl.float32)
                if ON_INPUT:
                    a = a * router[:, None]
                codes = _fp8(tl.math.div_rn(a, tl.broadcast_to(x_scale, a.shape)), NATIVE_FP8)
                if INTERPRETED:
                    codes, b_gate, b_up = codes.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                # Added by the CUDA cores each step: Hopper's fp8 MMA accumulator has fewer bits than fp32.
                gate += tl.dot(codes, b_gate)
                up += tl.dot(codes, b_up)
    if QUANT == PER_TENSOR:
        w_scale = tl.load(w1_scale_ptr + expert * stride_se)
        gate = gate * (x_scale * w_scale)
        up = up * (x_scale * w_scale)
    if QUANT == NVFP4:  # W = e2m1 sf / gs: the expert's gs divides the sum
        global_scale = tl.load(w1_global_ptr + expert * stride_ge)
        gate = tl.math.div_rn(gate, tl.broadcast_to(global_scale, gate.shape))
        up = tl.math.div_rn(up, tl.broadcast_to(global_scale, up.shape))
    inter = _gated(gate, up, GELU, HIDDEN, INTERPRETED)
    mask = valid[:, None] & n_ok[None, :]
    out = inter_ptr + row[:, None].to(tl.int64) * stride_im + n[None, :]
    if QUANT == BLOCKWISE:  # the spec quantizes the rounded intermediate, 1 x 128 per pair
        codes, scale = _quantize_groups(tl.where(mask, inter.to(tl.float32), 0.0), NATIVE_FP8)
        tl.store(out, codes, mask=mask)
        tl.store(inter_scale_ptr + row.to(tl.int64) * stride_is + tile_n, scale, mask=valid)
    else:
        tl.store(out, inter, mask=mask)
    if QUANT == PER_TENSOR:  # the intermediate's one scale needs its amax over every pair
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, tl.abs(inter.to(tl.float32)), 0.0), axis=1), axis=0))


@triton.jit
def moe_down_kernel(
    inter_ptr, inter_scale_ptr, w2_ptr, w2_scale_ptr, w2_global_ptr, amax_ptr, weights_ptr, out_ptr,
    sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, total_ptr,
    hidden_size, inter_size, max_blocks,
    stride_im, stride_is, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ge,
    stride_tw_t, stride_tw_k, stride_om,
    TOPK: tl.constexpr, ON_INPUT: tl.constexpr, QUANT: tl.constexpr, REDUCE: tl.constexpr,
    NATIVE_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """w[token, slot] * (inter[row] W2^T)[n] for a block's rows and a tile of n, to out per REDUCE:
    stored in out[token] (top-1), added into an fp32 out[token] (ATOMIC), or stored in the hidden
    dtype in out[pair] of a [T * k, H] buffer that moe_sum_kernel reduces (PAIRS). MXFP4 and NVFP4 read
    w2 as gate-up reads w1."""
    block_m, tile_n = grouped_tile(max_blocks, hidden_size, BLOCK_N, GROUP_M)
    if block_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert, row, valid, pair = _rows(sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, block_m, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden_size
    k = tl.arange(0, BLOCK_K)
    a_rows = inter_ptr + row[:, None].to(tl.int64) * stride_im
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn
    if QUANT == PER_TENSOR:
        a_scale = tl.maximum(tl.math.div_rn(tl.load(amax_ptr), FP8_MAX), SCALE_FLOOR)
    if QUANT == BLOCKWISE:
        tl.static_assert(BLOCK_K == GROUP)
        a_scale_rows = inter_scale_ptr + row.to(tl.int64) * stride_is
        w_scale_rows = w2_scale_ptr + expert.to(tl.int64) * stride_se + (n // GROUP) * stride_sn
    if QUANT == MXFP4 or QUANT == NVFP4:
        code_rows = w2_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
        scale_rows = w2_scale_ptr + expert.to(tl.int64) * stride_se + n[:, None].to(tl.int64) * stride_sn
        DOT: tl.constexpr = tl.float32 if INTERPRETED else inter_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = k0 + k < inter_size
        a = tl.load(a_rows + (k0 + k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if QUANT == MXFP4 or QUANT == NVFP4:
            acc = fp4_dot(a, acc, code_rows, scale_rows, n_ok, k0, inter_size, stride_wk, stride_sk, QUANT,
                           inter_ptr.dtype.element_ty, DOT, INTERPRETED, BLOCK_N, BLOCK_K)
        else:
            b = tl.load(w_rows + (k0 + k)[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if QUANT == NONE:
                if INTERPRETED:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc)
            elif QUANT == BLOCKWISE:  # a: gate-up's codes of one 1 x 128 group
                group_scale = tl.load(a_scale_rows + k0 // GROUP, mask=valid, other=0.0)
                s_w = tl.load(w_scale_rows + (k0 // GROUP) * stride_sk, mask=n_ok, other=0.0)
                if INTERPRETED:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc += tl.dot(a, b) * (group_scale[:, None] * s_w[None, :])
            else:
                codes = _fp8(tl.math.div_rn(a.to(tl.float32), tl.broadcast_to(a_scale, a.shape)), NATIVE_FP8)
                if INTERPRETED:
                    codes, b = codes.to(tl.float32), b.to(tl.float32)
                acc += tl.dot(codes, b)  # added by the CUDA cores each step, as in gate-up
    if QUANT == PER_TENSOR:
        acc = acc * (a_scale * tl.load(w2_scale_ptr + expert * stride_se))
    if QUANT == NVFP4:
        acc = tl.math.div_rn(acc, tl.broadcast_to(tl.load(w2_global_ptr + expert * stride_ge), acc.shape))
    token = (pair // TOPK).to(tl.int64)
    if not ON_INPUT:
        router = tl.load(weights_ptr + token * stride_tw_t + (pair % TOPK) * stride_tw_k, mask=valid, other=0.0)
        acc = acc * router[:, None]
    mask = valid[:, None] & n_ok[None, :]
    if REDUCE == ATOMIC:
        tl.atomic_add(out_ptr + token[:, None] * stride_om + n[None, :], acc, mask=mask)
    elif REDUCE == PAIRS:
        out = out_ptr + pair[:, None].to(tl.int64) * stride_om + n[None, :]
        tl.store(out, _round(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    else:
        out = out_ptr + token[:, None] * stride_om + n[None, :]
        tl.store(out, _round(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def moe_sum_kernel(pairs_ptr, ids_ptr, map_ptr, out_ptr, hidden_size, stride_pm, stride_it, stride_ik, stride_map,
                   stride_om, TOPK: tl.constexpr, HAS_MAP: tl.constexpr, INTERPRETED: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """out[token, n] = the sum over the token's k slots of the down kernel's PAIRS rows, in fp32,
    rounded once; a slot routed off-rank (never written) adds nothing."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        expert = _local_expert(ids_ptr, map_ptr, pair, pair >= 0, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
        live = n_ok & (expert + tl.zeros_like(n) >= 0)  # a vector mask: the interpreter refuses scalar & vector
        acc += tl.load(pairs_ptr + pair * stride_pm + n, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + n, _round(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=n_ok)


# ---------------------------------------------------------------------------------------------
# Decode: the GEMV kernels. At T = 1 every pair has its own expert, so a pair's program reads its expert's
# weights once with no routing layout, and the CUDA cores multiply (no tensor-core tile padded to 16 rows):
# programs stream [BLOCK_N, BLOCK_K] weight tiles into a fp32 product of the same shape, summed over k once.


@triton.jit
def _gemv_step(acc, x, w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT: tl.constexpr,
               INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + W[rows, k0:k0 + BLOCK_K] * x, elementwise in fp32: ``x`` the activations [BLOCK_K] in fp32,
    ``w_rows`` [BLOCK_N, 1] row pointers. NONE: acc is [BLOCK_N, BLOCK_K]. MXFP4 / NVFP4 (packed bytes,
    ``s_rows`` their block scales' rows): acc is [BLOCK_N, BLOCK_K / 2], each even and odd k's products
    added, times their block's scale and 2^-14 (_fp4_kernel.fp4_gemv_step; gemv_sum restores it)."""
    if QUANT == NONE:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :] * stride_wk, mask=n_ok[:, None] & (k < size_k)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    else:  # not an early return: the compiler would build the branch below for NONE too
        acc = fp4_gemv_step(acc, x, w_rows, s_rows, n_ok, k0, size_k, stride_wk, stride_sk, QUANT, INTERPRETED,
                            BLOCK_K)
    return acc


@triton.jit
def moe_gemv_gate_up_kernel(
    x_ptr, w1_ptr, w1_scale_ptr, w1_global_ptr, weights_ptr, ids_ptr, map_ptr, inter_ptr,
    hidden_size, inter_size,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ge,
    stride_tw_t, stride_it, stride_ik, stride_map, stride_im,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr, GELU: tl.constexpr, QUANT: tl.constexpr,
    HIDDEN: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """inter[pair, n] for one (token, slot) pair (program axis 0) and a tile of n (axis 1): the gate and up
    rows of the pair's expert against its token's input, then moe_gate_up_kernel's epilogue. A pair routed
    off-rank writes nothing (the down GEMV skips it). NONE, MXFP4 and NVFP4 only."""
    pair = tl.program_id(0)
    expert = _local_expert(ids_ptr, map_ptr, pair, pair >= 0, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
    if expert < 0:
        return
    token = (pair // TOPK).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    gate_rows = w1_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter_size * stride_wn
    gate_scales = w1_scale_ptr + expert.to(tl.int64) * stride_se + n[:, None].to(tl.int64) * stride_sn
    up_scales = gate_scales + inter_size * stride_sn
    if ON_INPUT:  # k == 1: the pair's weight scales its input in fp32, rounded to the hidden dtype
        router = tl.load(weights_ptr + token * stride_tw_t)
    WIDTH: tl.constexpr = BLOCK_K if QUANT == NONE else BLOCK_K // 2
    gate = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xm + k * stride_xk, mask=k < hidden_size, other=0.0)
        if ON_INPUT:
            x = _round(x.to(tl.float32) * router, HIDDEN, INTERPRETED)
        x = x.to(tl.float32)
        gate = _gemv_step(gate, x, gate_rows, gate_scales, n_ok, k0, hidden_size, stride_wk, stride_sk, QUANT,
                          INTERPRETED, BLOCK_K)
        up = _gemv_step(up, x, up_rows, up_scales, n_ok, k0, hidden_size, stride_wk, stride_sk, QUANT,
                        INTERPRETED, BLOCK_K)
    global_ptr = w1_global_ptr + expert * stride_ge
    inter = _gated(gemv_sum(gate, global_ptr, QUANT), gemv_sum(up, global_ptr, QUANT), GELU, HIDDEN,
                   INTERPRETED)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + n, inter, mask=n_ok)


@triton.jit
def moe_gemv_down_kernel(
    inter_ptr, w2_ptr, w2_scale_ptr, w2_global_ptr, weights_ptr, ids_ptr, map_ptr, out_ptr,
    hidden_size, inter_size,
    stride_im, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ge,
    stride_tw_t, stride_tw_k, stride_it, stride_ik, stride_map, stride_om,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr, QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[token, n] for one token (program axis 0) and a tile of n (axis 1): each of its k slots' down rows
    against the slot's intermediate, times the router weight (unless it was applied on the input), summed
    over the slots in fp32 and rounded once: no per-pair buffer, no sum launch. A slot routed off-rank
    adds nothing (its loads are masked off: its intermediate row was never written)."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden_size
    lanes = tl.arange(0, BLOCK_K)
    WIDTH: tl.constexpr = BLOCK_K if QUANT == NONE else BLOCK_K // 2
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(TOPK):
        pair = token * TOPK + slot
        expert = _local_expert(ids_ptr, map_ptr, pair, pair >= 0, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
        # Vector masks (the interpreter refuses scalar & vector); the expert clamped to one that exists.
        live = expert + tl.zeros_like(n) >= 0
        live_k = expert + tl.zeros_like(lanes) >= 0
        expert = tl.maximum(expert, 0)
        rows_ok = n_ok & live
        w_rows = w2_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
        s_rows = w2_scale_ptr + expert.to(tl.int64) * stride_se + n[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + lanes
            a = tl.load(inter_ptr + pair * stride_im + k, mask=(k < inter_size) & live_k, other=0.0)
            acc = _gemv_step(acc, a.to(tl.float32), w_rows, s_rows, rows_ok, k0, inter_size, stride_wk, stride_sk,
                             QUANT, INTERPRETED, BLOCK_K)
        part = gemv_sum(acc, w2_global_ptr + expert * stride_ge, QUANT)
        if not ON_INPUT:
            part = part * tl.load(weights_ptr + token * stride_tw_t + slot * stride_tw_k)
        out += tl.where(live, part, 0.0)
    tl.store(out_ptr + token * stride_om + n, _round(out, out_ptr.dtype.element_ty, INTERPRETED), mask=n_ok)
