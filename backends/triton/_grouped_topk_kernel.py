"""The fused Triton kernel behind the triton backend's grouped_topk (host side: grouped_topk.py):
scoring, group selection and expert top-k for a block of rows in one pass over the logits."""

import triton
import triton.language as tl

# Ordered keys. ordered(x) maps the fp32 bits b to b ^ ((b >> 31) & 0x7FFFFFFF): non-negative
# floats keep their bits, negative floats have their 31 magnitude bits flipped, so signed int32
# order is float order (-inf < finite < +inf), and INT32_MIN (the bits of a negative NaN, never a
# score) lies below every real key: padding lanes, groups not kept and picked lanes hold it. It is
# an involution, so a key decodes back to its value exactly. -0.0 < +0.0 is the only order that
# differs from the floats'; scores are sigmoid/softmax outputs (+0.0 at worst) plus a bias, and
# +0.0 + -0.0 = +0.0, so -0.0 never reaches a key.
#
# One pick (a group or an expert) is
#     best = max(key); pick = min(where(key == best, id, BIG)); key = where(id == pick, NONE, key)
# exact, ties to the lowest id (the spec's rule), and one lane removed per pick so equal values
# are picked one at a time. Both reductions are int32 min/max: when the reduced axis spans a whole
# warp they are one REDUX each (an int64 key costs two shuffles and four compare/selects per
# butterfly level instead).
#
# Work saved elsewhere:
#   * group top-2 (with a bias) is max, then two independent reductions (how many lanes hold the
#     max; the max below it), so equal best values count twice as in the reference's topk(2);
#   * when at most half the groups are kept, the expert stage runs on a compacted
#     [BT, KG_PAD * GS_PAD] tile re-read from the logits (L1/L2-hot) instead of the masked row:
#     every pick scans KG_PAD / G_PAD of the row (half for DeepSeek-V3);
#   * the weight is no reduction: without a bias it is the winning key decoded; with one, the
#     chosen experts' logits are gathered once after the loop and scored with the tile's
#     expression, so weights and selection agree bit for bit;
#   * offsets are int32 unless the host says a tensor needs 64-bit ones (OFFSETS_64), masks that
#     are statically true are not built (BLOCK_T == 1 rows always exist, unpadded tiles), and the
#     sigmoid is exp2 + an approximate reciprocal (FAST_DIV: ~4 instructions an element instead of
#     ~12; a few ulp, far inside the contract's tolerance).


@triton.jit
def _ordered_bits(x):
    """fp32 -> int32 whose signed order is the float order (an involution on the bits)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered_value(k):
    """Inverse of _ordered_bits: int32 -> the fp32 it came from."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _score(x, row_max, inv_den, SIGMOID: tl.constexpr, FAST_DIV: tl.constexpr):
    # The kernel's one scoring expression (tile, compacted tile and weight gather all use it, so
    # a weight equals the score the selection saw, bit for bit).
    LOG2E: tl.constexpr = 1.4426950408889634
    if SIGMOID:
        # 2**(-x log2 e) overflows to inf for x < -88 and 1 / inf = 0, the correct limit.
        if FAST_DIV:
            return tl.math.fdiv(1.0, 1.0 + tl.exp2(x * -LOG2E), approx=True)
        else:
            return 1.0 / (1.0 + tl.exp2(x * -LOG2E))
    else:
        return tl.exp2((x - row_max) * LOG2E) * inv_den


@triton.jit
def _local_top2(x, BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr):
    """[BT, G_PAD, GS_PAD] -> (m1, m2) over [BT, G_PAD, GS_PAD / 4]: the largest and second
    largest (with multiplicity) of each run of 4 neighbouring lanes; runs of 2 or 1 when GS_PAD
    is that small. The runs are held by one thread (vectorized loads), so this is register work."""
    if GS_PAD >= 2:
        a, b = tl.split(tl.reshape(x, [BLOCK_T, G_PAD, GS_PAD // 2, 2]))
        hi = tl.maximum(a, b)
        lo = tl.minimum(a, b)
        if GS_PAD >= 4:
            h1, h2 = tl.split(tl.reshape(hi, [BLOCK_T, G_PAD, GS_PAD // 4, 2]))
            l1, l2 = tl.split(tl.reshape(lo, [BLOCK_T, G_PAD, GS_PAD // 4, 2]))
            return tl.maximum(h1, h2), tl.maximum(tl.minimum(h1, h2), tl.maximum(l1, l2))
        else:
            return hi, lo
    else:
        return x, tl.full(x.shape, float("-inf"), x.dtype)


@triton.jit
def _exchange(ka, ia, kb, ib):
    """One compare-exchange of (key, id) pairs, larger key first; equal keys keep their order."""
    swap = kb > ka
    return (tl.maximum(ka, kb), tl.where(swap, ib, ia), tl.minimum(ka, kb), tl.where(swap, ia, ib))


@triton.jit
def _offsets(index, stride, OFFSETS_64: tl.constexpr):
    if OFFSETS_64:
        return index.to(tl.int64) * stride
    else:
        return index * stride


@triton.jit
def grouped_topk_kernel(
    logits_ptr,  # [T, E] fp32/bf16/fp16, any strides
    bias_ptr,  # [E] fp32/bf16/fp16; any valid pointer when HAS_BIAS is False (never read)
    weights_ptr,  # [T, TOPK] fp32, contiguous
    ids_ptr,  # [T, TOPK] int32, contiguous
    num_tokens,
    stride_lt,
    stride_le,
    stride_b,
    scaling,  # routed_scaling_factor, fp32
    NUM_GROUPS: tl.constexpr,  # G
    GROUP_SIZE: tl.constexpr,  # E / G
    G_PAD: tl.constexpr,  # next_pow2(G)
    GS_PAD: tl.constexpr,  # next_pow2(E / G)
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # next_pow2(TOPK)
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,  # else softmax over the E experts
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # rows per program
    OFFSETS_64: tl.constexpr,  # False: every element offset of every tensor fits int32
    FAST_DIV: tl.constexpr,  # approximate reciprocal in the sigmoid (host: if available)
):
    KEY_NONE: tl.constexpr = -2147483648  # INT32_MIN: below every real key
    NO_ID: tl.constexpr = G_PAD * GS_PAD  # > every expert id and group id
    GROUPED: tl.constexpr = TOPK_GROUP < NUM_GROUPS
    # Kept-group slots of the compacted expert tile: the smallest G_PAD / 2**s >= TOPK_GROUP
    # (s <= 3); equal to G_PAD when compaction would not shrink the tile.
    KG_PAD: tl.constexpr = (
        G_PAD // 8 if TOPK_GROUP * 8 <= G_PAD
        else (G_PAD // 4 if TOPK_GROUP * 4 <= G_PAD
              else (G_PAD // 2 if TOPK_GROUP * 2 <= G_PAD else G_PAD))
    )
    COMPACT: tl.constexpr = GROUPED and KG_PAD < G_PAD
    # Statically true masks are not built: a program of one row always has its row (the grid is
    # T programs), and unpadded tiles have no padding lanes.
    ROWS_MASKED: tl.constexpr = BLOCK_T > 1
    G_PADDED: tl.constexpr = NUM_GROUPS < G_PAD
    GS_PADDED: tl.constexpr = GROUP_SIZE < GS_PAD
    LANES_PADDED: tl.constexpr = G_PADDED or GS_PADDED

    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    row_off = _offsets(rows, stride_lt, OFFSETS_64)  # [BLOCK_T]

    # The row as a [G_PAD, GS_PAD] tile: lane (g, j) is expert g * GROUP_SIZE + j, so a group is
    # one tile row whatever E / G is; lanes past G or E / G are padding.
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, GS_PAD)
    lane_ok = (g[:, None] < NUM_GROUPS) & (j[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + j[None, :]  # [G_PAD, GS_PAD]; padding lanes masked below
    lane_ok3 = lane_ok[None, :, :]
    ptrs = logits_ptr + row_off[:, None, None] + _offsets(expert, stride_le, OFFSETS_64)[None, :, :]
    if ROWS_MASKED and LANES_PADDED:
        x = tl.load(ptrs, mask=row_ok[:, None, None] & lane_ok3, other=0.0)
    elif ROWS_MASKED:
        x = tl.load(ptrs, mask=row_ok[:, None, None], other=0.0)
    elif LANES_PADDED:
        x = tl.load(ptrs, mask=lane_ok3, other=0.0)
    else:
        x = tl.load(ptrs)
    # (rows past T load zeros, so their softmax stays finite; they are never stored)
    x = x.to(tl.float32)

    row_max = tl.zeros([BLOCK_T], dtype=tl.float32)  # unused by sigmoid
    inv_den = tl.zeros([BLOCK_T], dtype=tl.float32)
    if not SIGMOID:
        if LANES_PADDED:
            x = tl.where(lane_ok3, x, float("-inf"))  # padding must not enter the max or the sum
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        num = tl.exp2((x - row_max[:, None, None]) * 1.4426950408889634)
        inv_den = 1.0 / tl.sum(tl.sum(num, axis=2), axis=1)
    scores = _score(x, row_max[:, None, None], inv_den[:, None, None], SIGMOID, FAST_DIV)

    if HAS_BIAS:
        bias_ptrs = bias_ptr + _offsets(expert, stride_b, OFFSETS_64)
        if LANES_PADDED:
            bias = tl.load(bias_ptrs, mask=lane_ok, other=0.0)
        else:
            bias = tl.load(bias_ptrs)
        biased = scores + bias.to(tl.float32)[None, :, :]
    else:
        biased = scores
    if LANES_PADDED:
        biased = tl.where(lane_ok3, biased, float("-inf"))  # padding lanes are never chosen

    g2 = g[None, :]
    kcols = tl.arange(0, KG_PAD)[None, :]
    kept_group = tl.zeros([BLOCK_T, KG_PAD], dtype=tl.int32)  # COMPACT: slot -> group
    gkey = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int32)  # not COMPACT: KEY_NONE marks kept groups
    if GROUPED:
        if HAS_BIAS:
            # Top-2 with multiplicity (as the reference's topk(2)): the best value twice when two
            # lanes hold it, else the best below it. The count and the max below are independent
            # reductions, so this is two reduction latencies, not three.
            m1, m2 = _local_top2(biased, BLOCK_T, G_PAD, GS_PAD)
            top1 = tl.max(m1, axis=2)
            n_top1 = tl.sum((m1 == top1[:, :, None]).to(tl.int32), axis=2)
            below = tl.max(tl.where(m1 < top1[:, :, None], m1, m2), axis=2)
            group_score = top1 + tl.where(n_top1 > 1, top1, below)  # padding groups: -inf
        else:
            group_score = tl.max(biased, axis=2)
        gkey = _ordered_bits(group_score)
        if G_PADDED:
            gkey = tl.where(g2 < NUM_GROUPS, gkey, KEY_NONE)
        # TOPK_GROUP picks: best group score, lowest group on ties.
        for i in tl.static_range(TOPK_GROUP):
            gbest = tl.max(gkey, axis=1)
            gpick = tl.min(tl.where(gkey == gbest[:, None], g2, NO_ID), axis=1)
            if COMPACT:
                kept_group = tl.where(kcols == i, gpick[:, None], kept_group)
            gkey = tl.where(g2 == gpick[:, None], KEY_NONE, gkey)

    if COMPACT:
        # Re-read only the kept groups' logits: slot s of row t holds group kept_group[t, s].
        SLOTS_PADDED: tl.constexpr = TOPK_GROUP < KG_PAD
        jj = j[None, None, :]
        cexpert = kept_group[:, :, None] * GROUP_SIZE + jj  # [BLOCK_T, KG_PAD, GS_PAD]
        cok = (kcols[:, :, None] < TOPK_GROUP) & (jj < GROUP_SIZE)
        if ROWS_MASKED:
            cok = cok & row_ok[:, None, None]
        CMASKED: tl.constexpr = ROWS_MASKED or SLOTS_PADDED or GS_PADDED
        cptrs = logits_ptr + row_off[:, None, None] + _offsets(cexpert, stride_le, OFFSETS_64)
        if CMASKED:
            cx = tl.load(cptrs, mask=cok, other=0.0)
        else:
            cx = tl.load(cptrs)
        cscores = _score(
            cx.to(tl.float32), row_max[:, None, None], inv_den[:, None, None], SIGMOID, FAST_DIV
        )
        if HAS_BIAS:
            cbias_ptrs = bias_ptr + _offsets(cexpert, stride_b, OFFSETS_64)
            if CMASKED:
                cbias = tl.load(cbias_ptrs, mask=cok, other=0.0)
            else:
                cbias = tl.load(cbias_ptrs)
            cscores = cscores + cbias.to(tl.float32)
        key3 = _ordered_bits(cscores)
        if SLOTS_PADDED or GS_PADDED:
            key3 = tl.where(cok, key3, KEY_NONE)  # rows past T: any keys, never stored
        id3 = cexpert
        N_LANES: tl.constexpr = KG_PAD * GS_PAD
    else:
        key3 = _ordered_bits(biased)
        if GROUPED:
            # Kept groups are the ones the picks knocked out (real group keys are never KEY_NONE).
            kept = gkey == KEY_NONE
            if G_PADDED:
                kept = kept & (g2 < NUM_GROUPS)
            key3 = tl.where(kept[:, :, None], key3, KEY_NONE)
        elif LANES_PADDED:
            key3 = tl.where(lane_ok3, key3, KEY_NONE)
        id3 = tl.broadcast_to(expert[None, :, :], [BLOCK_T, G_PAD, GS_PAD])
        N_LANES: tl.constexpr = G_PAD * GS_PAD
    cols = tl.arange(0, TOPK_PAD)[None, :]
    out_id = tl.zeros([BLOCK_T, TOPK_PAD], dtype=tl.int32)
    out_key = tl.zeros([BLOCK_T, TOPK_PAD], dtype=tl.int32)
    if GS_PAD >= 4:
        # Runs of 4 neighbouring lanes (one thread's vector) are sorted once, best first, and a
        # pick only looks at each run's head: the winner's run pops its head. Every pick then
        # costs one compare/select per run instead of four per lane; the order is exact because
        # the sort is stable (ties keep the lowest id first).
        k02, k13 = tl.split(tl.reshape(key3, [BLOCK_T, N_LANES // 4, 2, 2]))
        k0, k2 = tl.split(k02)
        k1, k3 = tl.split(k13)
        i02, i13 = tl.split(tl.reshape(id3, [BLOCK_T, N_LANES // 4, 2, 2]))
        i0, i2 = tl.split(i02)
        i1, i3 = tl.split(i13)
        # Odd-even transposition sort (adjacent exchanges on strict inversions only: stable).
        k0, i0, k1, i1 = _exchange(k0, i0, k1, i1)
        k2, i2, k3, i3 = _exchange(k2, i2, k3, i3)
        k1, i1, k2, i2 = _exchange(k1, i1, k2, i2)
        k0, i0, k1, i1 = _exchange(k0, i0, k1, i1)
        k2, i2, k3, i3 = _exchange(k2, i2, k3, i3)
        k1, i1, k2, i2 = _exchange(k1, i1, k2, i2)
        # TOPK picks; TOPK <= topk_group * E / G guarantees a real lane each time.
        for k in tl.static_range(TOPK):
            best = tl.max(k0, axis=1)  # [BLOCK_T]
            pick = tl.min(tl.where(k0 == best[:, None], i0, NO_ID), axis=1)
            pop = i0 == pick[:, None]
            k0 = tl.where(pop, k1, k0)
            k1 = tl.where(pop, k2, k1)
            k2 = tl.where(pop, k3, k2)
            k3 = tl.where(pop, KEY_NONE, k3)
            i0 = tl.where(pop, i1, i0)  # an emptied run keeps a stale id under a KEY_NONE head
            i1 = tl.where(pop, i2, i1)
            i2 = tl.where(pop, i3, i2)
            out_id = tl.where(cols == k, pick[:, None], out_id)
            if not HAS_BIAS:
                out_key = tl.where(cols == k, best[:, None], out_key)
    else:
        # One flat axis per row, so a pick's reductions run over the whole warp at once.
        key = tl.reshape(key3, [BLOCK_T, N_LANES])
        eid = tl.reshape(id3, [BLOCK_T, N_LANES])
        for k in tl.static_range(TOPK):
            best = tl.max(key, axis=1)  # [BLOCK_T]
            pick = tl.min(tl.where(key == best[:, None], eid, NO_ID), axis=1)
            key = tl.where(eid == pick[:, None], KEY_NONE, key)
            out_id = tl.where(cols == k, pick[:, None], out_id)
            if not HAS_BIAS:
                out_key = tl.where(cols == k, best[:, None], out_key)

    out_ok = cols < TOPK
    if HAS_BIAS:
        # Weight = unbiased score: gather the chosen logits (just read, so cache-hot) and score
        # them with the tile's expression.
        wptrs = logits_ptr + row_off[:, None] + _offsets(out_id, stride_le, OFFSETS_64)
        if ROWS_MASKED or TOPK < TOPK_PAD:
            wx = tl.load(wptrs, mask=row_ok[:, None] & out_ok, other=0.0)
        else:
            wx = tl.load(wptrs)
        out_w = _score(wx.to(tl.float32), row_max[:, None], inv_den[:, None], SIGMOID, FAST_DIV)
    else:
        out_w = _unordered_value(out_key)  # biased == score: decode it
    if TOPK < TOPK_PAD:
        out_w = tl.where(out_ok, out_w, 0.0)  # padding columns: 0 in the renormalizing sum

    if RENORMALIZE:
        # One division per row (its scale), a multiply per weight.
        out_w = out_w * (scaling / tl.sum(out_w, axis=1))[:, None]
    else:
        out_w = out_w * scaling

    out_offsets = _offsets(rows, TOPK, OFFSETS_64)[:, None] + cols
    if ROWS_MASKED or TOPK < TOPK_PAD:
        out_mask = row_ok[:, None] & out_ok
        tl.store(weights_ptr + out_offsets, out_w, mask=out_mask)
        tl.store(ids_ptr + out_offsets, out_id, mask=out_mask)
    else:
        tl.store(weights_ptr + out_offsets, out_w)
        tl.store(ids_ptr + out_offsets, out_id)
