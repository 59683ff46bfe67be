"""The triton backend's fused_moe kernels: the routing layout (count, lay out, scatter: every (token,
slot) pair placed in its local expert's run of rows, each run padded to whole BLOCK_M blocks, all on
the device) and the two grouped GEMMs over those blocks, gate-up with the gated activation in its
epilogue and down with the router weight and the top-k sum in its epilogue. Host side: fused_moe.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._fp8_kernel import FP8_MAX, e4m3fn_codes

# Quantization modes (constexpr QUANT): weights in the hidden dtype, fp8 with one scale per expert and
# one dynamic activation scale per tensor, fp8 with 128 x 128 weight blocks and 1 x 128 activation groups.
NONE = tl.constexpr(0)
PER_TENSOR = tl.constexpr(1)
BLOCKWISE = tl.constexpr(2)
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
def moe_count_kernel(ids_ptr, map_ptr, counts_ptr, num_pairs, stride_it, stride_ik, stride_map,
                     TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """counts[e] += the pairs routed to local expert e (counts zeroed by the host)."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pair < num_pairs
    expert = _local_expert(ids_ptr, map_ptr, pair, mask, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask & (expert >= 0))


@triton.jit
def moe_layout_kernel(counts_ptr, starts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts,
                      max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's first row (its run padded to whole blocks), the padded row count,
    and each block's expert (-1 past the last used block)."""
    expert = tl.arange(0, E_PAD)
    count = tl.load(counts_ptr + expert, mask=expert < num_experts, other=0)
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
def moe_scatter_kernel(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, num_pairs, stride_it, stride_ik, stride_map,
                       TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """sorted[row] = pair for a free row of the pair's expert's run (order within a run is free:
    every row is computed on its own)."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pair < num_pairs
    expert = _local_expert(ids_ptr, map_ptr, pair, mask, stride_it, stride_ik, stride_map, TOPK, HAS_MAP)
    local = mask & (expert >= 0)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=local)
    tl.store(sorted_ptr + row, pair, mask=local)


@triton.jit
def _tile(num_blocks_m, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block of rows, tile of columns) of this program: GROUP_M row blocks sweep a column tile
    together, so the weight tile they share is read from L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    rows = min(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


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
def moe_gate_up_kernel(
    x_ptr, w1_ptr, w1_scale_ptr, x_scale_ptr, weights_ptr, inter_ptr, amax_ptr,
    sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, total_ptr,
    hidden_size, inter_size, max_blocks,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_tw_t, stride_tw_k, stride_im,
    TOPK: tl.constexpr, ON_INPUT: tl.constexpr, GELU: tl.constexpr, QUANT: tl.constexpr,
    NATIVE_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """inter[row, n] = act(x W1_gate^T)[n] * (x W1_up^T)[n] for a block's rows and a tile of n, in the
    hidden dtype (fp32 accumulation; gate and up rounded to it first, as the spec's dataflow)."""
    block_m, tile_n = _tile(max_blocks, inter_size, BLOCK_N, GROUP_M)
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
    if ON_INPUT:  # k == 1: the pair's weight scales its input, in fp32
        router = tl.load(weights_ptr + token * stride_tw_t, mask=valid, other=0.0)
    if QUANT == PER_TENSOR:
        x_scale = tl.load(x_scale_ptr)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + k < hidden_size
        a = tl.load(x_rows + (k0 + k)[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b_gate = tl.load(w_gate + (k0 + k)[:, None] * stride_wk, mask=b_mask, other=0.0)
        b_up = tl.load(w_up + (k0 + k)[:, None] * stride_wk, mask=b_mask, other=0.0)
        if QUANT == NONE:
            if ON_INPUT:
                a = _round(a.to(tl.float32) * router[:, None], x_ptr.dtype.element_ty, INTERPRETED)
            if INTERPRETED:
                a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
            gate = tl.dot(a, b_gate, gate)
            up = tl.dot(a, b_up, up)
        else:
            a = a.to(tl.float32)
            if ON_INPUT:
                a = a * router[:, None]
            if QUANT == BLOCKWISE:  # BLOCK_K == GROUP: one activation group and one weight block column
                codes, a_scale = _quantize_groups(a, NATIVE_FP8)
                scale_col = w1_scale_ptr + expert.to(tl.int64) * stride_se + (k0 // GROUP) * stride_sk
                s_gate = tl.load(scale_col + (n // GROUP) * stride_sn, mask=n_ok, other=0.0)
                s_up = tl.load(scale_col + ((inter_size + n) // GROUP) * stride_sn, mask=n_ok, other=0.0)
                if INTERPRETED:
                    codes, b_gate, b_up = codes.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                gate += tl.dot(codes, b_gate) * (a_scale[:, None] * s_gate[None, :])
                up += tl.dot(codes, b_up) * (a_scale[:, None] * s_up[None, :])
            else:
                codes = _fp8(tl.math.div_rn(a, tl.broadcast_to(x_scale, a.shape)), NATIVE_FP8)
                if INTERPRETED:
                    codes, b_gate, b_up = codes.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
                gate = tl.dot(codes, b_gate, gate)
                up = tl.dot(codes, b_up, up)
    if QUANT == PER_TENSOR:
        w_scale = tl.load(w1_scale_ptr + expert * stride_se)
        gate = gate * (x_scale * w_scale)
        up = up * (x_scale * w_scale)
    dtype = inter_ptr.dtype.element_ty
    gate = _round(gate, dtype, INTERPRETED).to(tl.float32)
    up = _round(up, dtype, INTERPRETED).to(tl.float32)
    if GELU:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    inter = _round(act * up, dtype, INTERPRETED)
    mask = valid[:, None] & n_ok[None, :]
    tl.store(inter_ptr + row[:, None].to(tl.int64) * stride_im + n[None, :], inter, mask=mask)
    if QUANT == PER_TENSOR:  # the intermediate's one scale needs its amax over every pair
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, tl.abs(inter.to(tl.float32)), 0.0), axis=1), axis=0))


@triton.jit
def moe_down_kernel(
    inter_ptr, w2_ptr, w2_scale_ptr, amax_ptr, weights_ptr, out_ptr,
    sorted_ptr, block_expert_ptr, starts_ptr, counts_ptr, total_ptr,
    hidden_size, inter_size, max_blocks,
    stride_im, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_tw_t, stride_tw_k, stride_om,
    TOPK: tl.constexpr, ON_INPUT: tl.constexpr, QUANT: tl.constexpr, ACCUMULATE: tl.constexpr,
    NATIVE_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[token, n] (+)= w[token, slot] * (inter[row] W2^T)[n] for a block's rows and a tile of n:
    ACCUMULATE adds into an fp32 output (top-k > 1 pairs of a token meet there), else stores."""
    block_m, tile_n = _tile(max_blocks, hidden_size, BLOCK_N, GROUP_M)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = k0 + k < inter_size
        a = tl.load(a_rows + (k0 + k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + (k0 + k)[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if QUANT == NONE:
            if INTERPRETED:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        elif QUANT == BLOCKWISE:
            codes, group_scale = _quantize_groups(a.to(tl.float32), NATIVE_FP8)
            s_w = tl.load(w2_scale_ptr + expert.to(tl.int64) * stride_se + (n // GROUP) * stride_sn
                          + (k0 // GROUP) * stride_sk, mask=n_ok, other=0.0)
            if INTERPRETED:
                codes, b = codes.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(codes, b) * (group_scale[:, None] * s_w[None, :])
        else:
            codes = _fp8(tl.math.div_rn(a.to(tl.float32), tl.broadcast_to(a_scale, a.shape)), NATIVE_FP8)
            if INTERPRETED:
                codes, b = codes.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(codes, b, acc)
    if QUANT == PER_TENSOR:
        acc = acc * (a_scale * tl.load(w2_scale_ptr + expert * stride_se))
    token = (pair // TOPK).to(tl.int64)
    if not ON_INPUT:
        router = tl.load(weights_ptr + token * stride_tw_t + (pair % TOPK) * stride_tw_k, mask=valid, other=0.0)
        acc = acc * router[:, None]
    out = out_ptr + token[:, None] * stride_om + n[None, :]
    mask = valid[:, None] & n_ok[None, :]
    if ACCUMULATE:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, _round(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
