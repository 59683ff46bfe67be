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
