"""The fused Triton kernel behind the triton backend's grouped_topk: scoring, group selection and
expert top-k for a block of rows in one pass over the logits (the host side is grouped_topk.py)."""

import triton
import triton.language as tl


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
):
    NEG_INF: tl.constexpr = float("-inf")
    # Larger than any expert id: the "no lane" value of the lowest-index-attaining-the-max search.
    NO_EXPERT: tl.constexpr = G_PAD * GS_PAD * 2

    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens

    # The row is held as a [G_PAD, GS_PAD] tile: lane (g, j) is expert g * GROUP_SIZE + j, so a
    # group is one tile row whatever E / G is; lanes past G or E / G are padding.
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, GS_PAD)
    lane_ok = (g[:, None] < NUM_GROUPS) & (j[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + j[None, :]
    # Padding lanes get id -1: their in-tile ids would alias real experts of the next group when
    # E / G is not a power of two, and -1 never equals a chosen id.
    eid = tl.where(lane_ok, expert, -1)[None, :, :]  # [1, G_PAD, GS_PAD]
    lane_ok3 = lane_ok[None, :, :]

    # 64-bit offsets: T * stride_lt (or E * stride_le for a transposed view) can pass 2**31.
    ptrs = (
        logits_ptr
        + rows.to(tl.int64)[:, None, None] * stride_lt
        + expert.to(tl.int64)[None, :, :] * stride_le
    )
    # Rows past T load zeros rather than -inf so that their softmax stays finite (no 0/0); they
    # are never stored.
    x = tl.load(ptrs, mask=row_ok[:, None, None] & lane_ok3, other=0.0).to(tl.float32)

    if SIGMOID:
        # exp(-x) overflows to inf for x < -88 and gives 0, the correctly rounded limit.
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(lane_ok3, x, NEG_INF)  # padding must not enter the max or the sum
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        num = tl.exp(x - row_max[:, None, None])
        inv_den = 1.0 / tl.sum(tl.sum(num, axis=2), axis=1)
        scores = num * inv_den[:, None, None]

    # `biased` ranks groups and experts; padding lanes are -inf so they are never chosen.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_b, mask=lane_ok, other=0.0).to(tl.float32)
        biased = tl.where(lane_ok3, scores + bias[None, :, :], NEG_INF)
    else:
        biased = tl.where(lane_ok3, scores, NEG_INF)

    if TOPK_GROUP < NUM_GROUPS:
        top1 = tl.max(biased, axis=2)  # [BLOCK_T, G_PAD]
        if HAS_BIAS:
            # Second best = the max after removing only the first lane attaining the best, so a
            # group whose two best scores are equal still sums both.
            j3 = j[None, None, :]
            first = tl.min(tl.where(biased == top1[:, :, None], j3, GS_PAD), axis=2)
            top2 = tl.max(tl.where(j3 == first[:, :, None], NEG_INF, biased), axis=2)
            group_score = top1 + top2  # padding groups: -inf
        else:
            group_score = top1
        g2 = g[None, :]
        kept = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int32)
        # TOPK_GROUP rounds of "take the best group, lowest index on ties, then remove it": exactly
        # TOPK_GROUP groups are kept even when group scores tie.
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == best[:, None], g2, G_PAD), axis=1)
            hit = g2 == pick[:, None]
            kept = tl.where(hit, 1, kept)
            group_score = tl.where(hit, NEG_INF, group_score)
        candidates = tl.where(kept[:, :, None] != 0, biased, NEG_INF)
    else:
        candidates = biased  # every group is kept: skip group scoring entirely

    cols = tl.arange(0, TOPK_PAD)[None, :]
    out_w = tl.zeros([BLOCK_T, TOPK_PAD], dtype=tl.float32)
    out_id = tl.zeros([BLOCK_T, TOPK_PAD], dtype=tl.int32)
    # Same selection for the experts; TOPK <= topk_group * E / G guarantees a finite best each round.
    for k in tl.static_range(TOPK):
        best = tl.max(tl.max(candidates, axis=2), axis=1)  # [BLOCK_T]
        pick = tl.min(
            tl.min(tl.where(candidates == best[:, None, None], eid, NO_EXPERT), axis=2), axis=1
        )
        hit = eid == pick[:, None, None]
        if HAS_BIAS:
            # The weight is the unbiased score of the chosen expert.
            weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        else:
            weight = best  # biased == scores on real lanes: no second reduction needed
        out_w = tl.where(cols == k, weight[:, None], out_w)
        out_id = tl.where(cols == k, pick[:, None], out_id)
        candidates = tl.where(hit, NEG_INF, candidates)

    if RENORMALIZE:
        out_w = out_w / tl.sum(out_w, axis=1)[:, None]  # padding columns hold 0
    out_w = out_w * scaling

    out_offsets = rows[:, None] * TOPK + cols
    out_mask = row_ok[:, None] & (cols < TOPK)
    tl.store(weights_ptr + out_offsets, out_w, mask=out_mask)
    tl.store(ids_ptr + out_offsets, out_id, mask=out_mask)


# ---------------------------------------------------------------------------------------------
# The packed kernel: same arguments and results as grouped_topk_kernel, far fewer reductions.
#
# Packed keys. A pick used to be a max, a min-index over the lanes attaining it and (with a bias)
# a masked sum to read the unbiased score: three dependent cross-lane reductions. Here each
# candidate lane holds one int64 key
#
#     key = ordered(value) << 32 | (LOW_BIG - expert_id)          (LOW_BIG > every expert id)
#
# where ordered(x) maps the fp32 bits b to b ^ ((b >> 31) & 0x7FFFFFFF): non-negative floats
# keep their bits, negative floats have their 31 magnitude bits flipped, so signed int32 order
# is float order (-inf < finite < +inf). It is an involution, so the value decodes back exactly.
# Why one tl.max is exact:
#   * the high word compares first, so the max key holds the largest value, bit for bit;
#   * among lanes with that value the low word is largest for the lowest expert id, i.e. ties go
#     to the lowest id exactly as in the baseline (and torch's reference rule for the contract);
#   * ids are unique per row, so keys are unique: "knock out the lane whose key == best" removes
#     exactly one lane, so equal scores are picked one at a time, never dropped together;
#   * padding lanes, lanes of groups not kept and picked lanes hold INT64_MIN, below the key of
#     every real value (the lowest real high word is ordered(-inf) > INT32_MIN, low word >= 1).
# The only values whose float order differs from their key order are -0.0 < +0.0 (equal as
# floats) and NaNs; scores are sigmoid/softmax outputs (+0.0 at worst, never -0.0) plus a bias,
# and +0.0 + -0.0 = +0.0, so -0.0 never reaches a key; NaN inputs are garbage-in either way.
#
# Other reductions saved:
#   * group top-2 (with a bias) is max, then two independent reductions (how many lanes hold the
#     max; the max below it), so equal best values count twice as in the reference's topk(2).
#     (A tl.reduce over (best, second) pairs with a custom combine is one reduction on the GPU,
#     but the interpreter runs custom combines per element in Python: ~20x slower tests.)
#   * group picks are packed the same way (group score << 32 | LOW_BIG - group) over [BT, G];
#   * the kept groups' ids come out of the group keys' low words, and when at most half the
#     groups are kept the expert stage runs on a compacted [BT, KG_PAD, GS_PAD] tile that is
#     re-read from the logits (L1/L2-hot) instead of the masked full row: every pick scans
#     KG_PAD / G_PAD of the row (half for DeepSeek-V3);
#   * the chosen id is the winning key's low word (no min-index reduction) and the weight is no
#     reduction either: without a bias it is the winning key's decoded value; with one, the
#     chosen experts' logits are gathered once after the loop ([BT, TOPK_PAD] loads) and scored
#     with the same expression as the tile, so the weight is bit-identical to the baseline's.


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
def _pack(value, low):
    """int64 key: ordered(value) in the high word, `low` (0 <= low < 2**31) in the low word."""
    return (_ordered_bits(value).to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _score(x, row_max, inv_den, SIGMOID: tl.constexpr):
    # The one scoring expression of the packed kernel (tile, compacted tile and weight gather
    # all use it, so a weight equals the score the selection saw, bit for bit).
    if SIGMOID:
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        return tl.exp(x - row_max) * inv_den


@triton.jit
def grouped_topk_kernel_packed(
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
):
    NEG_INF: tl.constexpr = float("-inf")
    KEY_NONE: tl.constexpr = -9223372036854775807 - 1  # INT64_MIN: below every real key
    LOW_BIG: tl.constexpr = G_PAD * GS_PAD * 2  # > every expert id and group id
    GROUPED: tl.constexpr = TOPK_GROUP < NUM_GROUPS
    # Kept-group slots of the compacted expert tile: the smallest G_PAD / 2**s >= TOPK_GROUP
    # (s <= 3); equal to G_PAD when compaction would not shrink the tile.
    KG_PAD: tl.constexpr = (
        G_PAD // 8 if TOPK_GROUP * 8 <= G_PAD
        else (G_PAD // 4 if TOPK_GROUP * 4 <= G_PAD
              else (G_PAD // 2 if TOPK_GROUP * 2 <= G_PAD else G_PAD))
    )
    COMPACT: tl.constexpr = GROUPED and KG_PAD < G_PAD

    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    row_off = rows.to(tl.int64)[:, None, None] * stride_lt  # 64-bit: T * stride_lt can pass 2**31

    g = tl.arange(0, G_PAD)
    j = tl.arange(0, GS_PAD)
    lane_ok = (g[:, None] < NUM_GROUPS) & (j[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + j[None, :]  # [G_PAD, GS_PAD]; padding lanes masked below
    lane_ok3 = lane_ok[None, :, :]

    x = tl.load(
        logits_ptr + row_off + expert.to(tl.int64)[None, :, :] * stride_le,
        mask=row_ok[:, None, None] & lane_ok3,
        other=0.0,  # rows past T: zeros keep their softmax finite; they are never stored
    ).to(tl.float32)

    row_max = tl.zeros([BLOCK_T], dtype=tl.float32)  # unused by sigmoid
    inv_den = tl.zeros([BLOCK_T], dtype=tl.float32)
    if not SIGMOID:
        x = tl.where(lane_ok3, x, NEG_INF)  # padding must not enter the max or the sum
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        num = tl.exp(x - row_max[:, None, None])
        inv_den = 1.0 / tl.sum(tl.sum(num, axis=2), axis=1)
    scores = _score(x, row_max[:, None, None], inv_den[:, None, None], SIGMOID)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_b, mask=lane_ok, other=0.0).to(tl.float32)
        biased = tl.where(lane_ok3, scores + bias[None, :, :], NEG_INF)
    else:
        biased = tl.where(lane_ok3, scores, NEG_INF)

    if GROUPED:
        if HAS_BIAS:
            # Top-2 with multiplicity (as the reference's topk(2)): the best value twice when two
            # lanes hold it, else the best below it. The count and the max below are independent
            # reductions, so this is two reduction latencies, not three.
            top1 = tl.max(biased, axis=2)
            n_top1 = tl.sum((biased == top1[:, :, None]).to(tl.int32), axis=2)
            below = tl.max(tl.where(biased < top1[:, :, None], biased, NEG_INF), axis=2)
            group_score = top1 + tl.where(n_top1 > 1, top1, below)  # padding groups: -inf
        else:
            group_score = tl.max(biased, axis=2)
        g2 = g[None, :]
        gkey = tl.where(g2 < NUM_GROUPS, _pack(group_score, LOW_BIG - g2), KEY_NONE)
        gkey_all = gkey
        kcols = tl.arange(0, KG_PAD)[None, :]
        kept_group = tl.zeros([BLOCK_T, KG_PAD], dtype=tl.int32)
        gbest = tl.zeros([BLOCK_T], dtype=tl.int64)
        # TOPK_GROUP picks, one packed max each: best group score, lowest group on ties.
        for i in tl.static_range(TOPK_GROUP):
            gbest = tl.max(gkey, axis=1)
            if COMPACT:
                kept_group = tl.where(kcols == i, LOW_BIG - gbest[:, None].to(tl.int32), kept_group)
            gkey = tl.where(gkey == gbest[:, None], KEY_NONE, gkey)

    if COMPACT:
        # Re-read only the kept groups' logits: slot s of row t holds group kept_group[t, s].
        kg3 = kept_group[:, :, None]
        jj = j[None, None, :]
        cexpert = kg3 * GROUP_SIZE + jj  # [BLOCK_T, KG_PAD, GS_PAD]
        cok = row_ok[:, None, None] & (kcols[:, :, None] < TOPK_GROUP) & (jj < GROUP_SIZE)
        cx = tl.load(
            logits_ptr + row_off + cexpert.to(tl.int64) * stride_le, mask=cok, other=0.0
        ).to(tl.float32)
        cscores = _score(cx, row_max[:, None, None], inv_den[:, None, None], SIGMOID)
        if HAS_BIAS:
            cbias = tl.load(bias_ptr + cexpert * stride_b, mask=cok, other=0.0).to(tl.float32)
            cscores = cscores + cbias
        key = tl.where(cok, _pack(cscores, LOW_BIG - cexpert), KEY_NONE)
    else:
        key = tl.where(lane_ok3, _pack(biased, LOW_BIG - expert[None, :, :]), KEY_NONE)
        if GROUPED:
            # Kept groups: keys at or above the last group picked (group keys are unique).
            kept = gkey_all >= gbest[:, None]
            key = tl.where(kept[:, :, None], key, KEY_NONE)

    cols = tl.arange(0, TOPK_PAD)[None, :]
    out_key = tl.full([BLOCK_T, TOPK_PAD], KEY_NONE, dtype=tl.int64)
    # TOPK picks, one packed max each; TOPK <= topk_group * E / G guarantees a real lane each time.
    for k in tl.static_range(TOPK):
        best = tl.max(tl.max(key, axis=2), axis=1)  # [BLOCK_T]
        out_key = tl.where(cols == k, best[:, None], out_key)
        key = tl.where(key == best[:, None, None], KEY_NONE, key)

    out_id = LOW_BIG - out_key.to(tl.int32)  # the low words (padding columns: never stored)
    out_ok = cols < TOPK
    if HAS_BIAS:
        # Weight = unbiased score: gather the chosen logits (just read, so cache-hot) and score
        # them with the tile's expression.
        wx = tl.load(
            logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + out_id.to(tl.int64) * stride_le,
            mask=row_ok[:, None] & out_ok,
            other=0.0,
        ).to(tl.float32)
        out_w = _score(wx, row_max[:, None], inv_den[:, None], SIGMOID)
    else:
        out_w = _unordered_value((out_key >> 32).to(tl.int32))  # biased == score: decode it
    out_w = tl.where(out_ok, out_w, 0.0)  # padding columns: 0 in the renormalizing sum

    if RENORMALIZE:
        out_w = out_w / tl.sum(out_w, axis=1)[:, None]
    out_w = out_w * scaling

    out_offsets = rows[:, None] * TOPK + cols
    out_mask = row_ok[:, None] & out_ok
    tl.store(weights_ptr + out_offsets, out_w, mask=out_mask)
    tl.store(ids_ptr + out_offsets, out_id, mask=out_mask)
