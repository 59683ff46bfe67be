"""The Triton kernels behind the triton backend's paged_attention and mla_decode (host side:
_attention.py): tiled flash attention over a paged KV cache, and the merge of split-KV partials."""

import triton
import triton.language as tl

# One program computes a tile of ``BLOCK_M`` query rows against one KV head. A row is a (query
# token, query head) pair: the tile holds ``HEADS_PER_TILE`` query heads of one KV head for
# ``BLOCK_M // HEADS_PER_TILE`` consecutive tokens of one sequence, so every KV row a program
# loads is used by all the query heads that share it (GQA), and by several tokens in prefill.
# mla_decode is the same kernel with one KV "head" whose rows are the latent cache: keys are the
# whole row (``D_MAIN`` latent dims, then ``D_ROPE`` rope dims) and values its first ``D_MAIN``
# dims, taken from the key tile already in registers (``V_FROM_K``).
#
# Grid: axis 0 = (KV head, head tile), fastest, so the programs that share a KV head's rows (MLA's
# head tiles) run side by side and meet in L2; axis 1 = query tile (in reverse with several
# queries per sequence: the heaviest causal tiles start first); axis 2 = KV split. With
# ``SPLIT_KV`` (``num_splits > 1``) each program covers one contiguous share of its tile's KV
# range and writes an unnormalized partial (acc, running max, running sum) that
# ``merge_splits_kernel`` combines; with one split the program writes the final output itself.
# The split count is a runtime argument, so batches that split differently share one compiled
# kernel.
#
# Softmax runs in base 2 (scores pre-multiplied by log2 e, ``exp2``), in fp32. P is rounded to
# the query dtype for ``P @ V``, as FlashAttention does (the specs' tolerances cover it).

# Module constants must be tl.constexpr instances (Triton 3.6 rejects annotated globals).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _find_sequence(cu_q_ptr, stride_cu, tile, num_seqs, TOKENS_PER_TILE: tl.constexpr):
    """The sequence owning query tile ``tile``: sequence b's tiles start at
    ``cu_q[b] // TOKENS_PER_TILE + b``, a strictly increasing index that leaves every sequence at
    least ceil(q_len / TOKENS_PER_TILE) tiles (the host launches T // TOKENS_PER_TILE + B)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_ptr + mid * stride_cu) // TOKENS_PER_TILE + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _finite_abs(x):
    """|x| where finite, else 0 (NaN compares false)."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _load_pages(table_row, stride_bp, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                MASK: tl.constexpr):
    """The cache block of each KV position start .. start + BLOCK_N (0 past ``hi`` with MASK);
    ``stride_bp`` steps along a block-table row (Triton specializes it when it is 1)."""
    n = start + tl.arange(0, BLOCK_N)
    entries = table_row + (n // BLOCK_SIZE) * stride_bp
    if MASK:
        return tl.load(entries, mask=n < hi, other=0).to(tl.int64)
    return tl.load(entries).to(tl.int64)


@triton.jit
def _attend_step(
    acc, l_i, m_i, q, q_rope, start, hi, page, row_pos, window, scale, soft_cap, k_head, v_head,
    stride_kb, stride_ks, stride_vb, stride_vs, dot_dtype, d, r,
    BLOCK_N: tl.constexpr, D_MAIN: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASK_RANGE: tl.constexpr, MASK_CAUSAL: tl.constexpr,
    MASK_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, V_FROM_K: tl.constexpr,
):
    """One online-softmax step over KV positions start .. start + BLOCK_N, whose cache blocks
    are ``page`` (_load_pages): gather the K (and V) rows, score, mask what the constexprs say,
    rescale, accumulate."""
    n = start + tl.arange(0, BLOCK_N)
    if MASK_RANGE:
        n_ok = n < hi
    else:
        n_ok = tl.full([BLOCK_N], True, tl.int1)
    d_ok = d < D_MAIN
    slot = (n % BLOCK_SIZE).to(tl.int64)
    k_rows = k_head + page * stride_kb + slot * stride_ks
    if MASK_RANGE or BLOCK_D != D_MAIN:
        k = tl.load(k_rows[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_rows[:, None] + d[None, :])
    k = k.to(dot_dtype)
    s = tl.dot(q, tl.trans(k))
    if D_ROPE > 0:
        k_rope = tl.load(k_rows[:, None] + D_MAIN + r[None, :], mask=n_ok[:, None] & (r < D_ROPE)[None, :],
                         other=0.0)
        s = tl.dot(q_rope, tl.trans(k_rope.to(dot_dtype)), s)
    if SOFT_CAP:
        # cap * tanh(x / cap), tanh from one exp2 of -2|x|: no overflow for any x.
        x = s * (scale / soft_cap)
        e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
        t = (1.0 - e) / (1.0 + e)
        s = tl.where(x < 0, -t, t) * (soft_cap * LOG2E)
    else:
        s = s * scale
    if MASK_RANGE:
        visible = n_ok[None, :]
        if MASK_CAUSAL:
            visible = visible & (n[None, :] <= row_pos[:, None])
        if MASK_WINDOW:
            visible = visible & (n[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; exponents then use 0 (p = 0, alpha = 0).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:
        v = k
    else:
        v_rows = v_head + page * stride_vb + slot * stride_vs
        if MASK_RANGE or BLOCK_D != D_MAIN:
            v = tl.load(v_rows[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_rows[:, None] + d[None, :])
        v = v.to(dot_dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v)
    return acc, l_i, m_new


@triton.jit
def _attend_range(
    acc, l_i, m_i, page, first, last, q, q_rope, hi, row_pos, window, scale, soft_cap, table_row, stride_bp,
    k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs, dot_dtype, d, r,
    BLOCK_N: tl.constexpr, D_MAIN: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASK_RANGE: tl.constexpr, MASK_CAUSAL: tl.constexpr,
    MASK_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, V_FROM_K: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
):
    """_attend_step over KV positions first .. last in steps of BLOCK_N. With PREFETCH_PAGES,
    ``page`` holds the first step's block-table entries and each step loads the next one's: the
    K/V gathers then depend on no load of their own iteration, and Triton's pipeliner keeps
    num_stages - 1 KV tiles in flight instead of spending a stage on the table load (it costs
    the registers of the next step's entries, which the decode and MLA plans cannot spare).
    Returns the accumulators and, with PREFETCH_PAGES, the entries of the step after ``last``."""
    for start in range(first, last, BLOCK_N):
        if PREFETCH_PAGES:
            step_page = page
            page = _load_pages(table_row, stride_bp, start + BLOCK_N, hi, BLOCK_N, BLOCK_SIZE, True)
        else:
            step_page = _load_pages(table_row, stride_bp, start, hi, BLOCK_N, BLOCK_SIZE, MASK_RANGE)
        acc, l_i, m_i = _attend_step(
            acc, l_i, m_i, q, q_rope, start, hi, step_page, row_pos, window, scale, soft_cap, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, dot_dtype, d, r,
            BLOCK_N, D_MAIN, D_ROPE, BLOCK_D, BLOCK_SIZE, MASK_RANGE, MASK_CAUSAL, MASK_WINDOW, SOFT_CAP,
            V_FROM_K)
    return acc, l_i, m_i, page


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D_MAIN + D_ROPE], any strides but the last (unit)
    k_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D_MAIN + D_ROPE]
    v_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D_MAIN]; unused with V_FROM_K
    out_ptr,  # [T, Hq, D_MAIN] in q's dtype (not SPLIT_KV)
    lse_ptr,  # [T, Hq] fp32 (RETURN_LSE, not SPLIT_KV)
    part_acc_ptr,  # [num_splits, T, Hq, D_MAIN] fp32 (SPLIT_KV)
    part_ml_ptr,  # [2, num_splits, T, Hq] fp32: running max (base 2) then running sum
    cu_q_ptr,  # [B + 1] int32, any stride
    block_table_ptr,  # [B, max_blocks] int32, any strides
    seq_lens_ptr,  # [B] int32, any stride
    sinks_ptr,  # [Hq] fp32 (HAS_SINKS), any stride
    k_scale_ptr,  # fp32 scalar (HAS_K_SCALE)
    v_scale_ptr,  # fp32 scalar (HAS_V_SCALE)
    num_seqs,
    num_tokens,
    num_splits,  # shares of each tile's KV range (> 1 only with SPLIT_KV)
    scale,  # softmax scale (not yet in base 2)
    soft_cap,  # > 0 with SOFT_CAP
    window,  # > 0 with WINDOW
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_bp,  # block table: rows (sequences), entries
    stride_cu, stride_sl, stride_sink,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_TILE: tl.constexpr,  # query heads of one KV head in a tile (<= GROUP)
    BLOCK_M: tl.constexpr,  # rows per tile: (BLOCK_M // HEADS_PER_TILE) tokens x HEADS_PER_TILE
    BLOCK_N: tl.constexpr,  # KV positions per step
    D_MAIN: tl.constexpr,  # value width (and the first part of the key)
    D_ROPE: tl.constexpr,  # extra key dims after D_MAIN (MLA's rope part), or 0
    BLOCK_D: tl.constexpr,  # next_pow2(D_MAIN)
    BLOCK_R: tl.constexpr,  # next_pow2(D_ROPE), or 1 when D_ROPE == 0 (then never used)
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    ONE_QUERY_PER_SEQ: tl.constexpr,  # T == B and max_query_len == 1: tile b is sequence b
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # write partials for merge_splits_kernel
    DOT_FP32: tl.constexpr,  # upcast dot operands (the interpreter's bf16 dot is wrong)
    DOT_FP16: tl.constexpr,  # fp8 cache, bf16 queries: dots in fp16 (one cvt from e4m3); before DOT_FP32
    PREFETCH_PAGES: tl.constexpr,  # load each step's block-table entries a step ahead
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    HEAD_TILES: tl.constexpr = (GROUP + HEADS_PER_TILE - 1) // HEADS_PER_TILE
    kv_head = tl.program_id(0) // HEAD_TILES
    head_tile = tl.program_id(0) % HEAD_TILES
    split = tl.program_id(2)

    if ONE_QUERY_PER_SEQ:
        tile = tl.program_id(1)
        seq = tile
        local_tile = 0
    else:
        # Last tiles first: with causal masking a sequence's later tiles see the most keys, and
        # the GPU starts programs in launch order, so the longest start first instead of forming
        # the tail of the launch.
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = _find_sequence(cu_q_ptr, stride_cu, tile, num_seqs, TOKENS_PER_TILE)
        local_tile = tile - (tl.load(cu_q_ptr + seq * stride_cu) // TOKENS_PER_TILE + seq)
    q_start = tl.load(cu_q_ptr + seq * stride_cu)
    q_len = tl.load(cu_q_ptr + (seq + 1) * stride_cu) - q_start
    first_token = local_tile * TOKENS_PER_TILE  # within the sequence
    if first_token >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq * stride_sl)

    # Rows: token-major, head-minor.
    rows = tl.arange(0, BLOCK_M)
    row_token = first_token + rows // HEADS_PER_TILE  # within the sequence
    row_head_in_group = head_tile * HEADS_PER_TILE + rows % HEADS_PER_TILE
    row_ok = (row_token < q_len) & (row_head_in_group < GROUP) & (rows < TOKENS_PER_TILE * HEADS_PER_TILE)
    row_head = kv_head * GROUP + row_head_in_group
    token = (q_start + row_token).to(tl.int64)
    # kv position of each row's query: causal queries sit at the end of their sequence.
    row_pos = kv_len - q_len + row_token

    # The tile's kv range [lo, hi): what its first query can see from the left (window) up to
    # what its last query can see (causal).
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
    if CAUSAL:
        hi = kv_len - q_len + last_token + 1
    else:
        hi = kv_len
    lo = 0
    if WINDOW:
        lo = tl.maximum(kv_len - q_len + first_token - window + 1, 0)
    if SPLIT_KV:
        # Equal shares in whole BLOCK_N steps; trailing splits may be empty.
        share = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * share
        hi = tl.maximum(tl.minimum(hi, lo + share), lo)  # an empty split has hi == lo

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D_MAIN
    q_rows = q_ptr + token[:, None] * stride_qt + row_head[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    r = tl.arange(0, BLOCK_R)
    if D_ROPE > 0:
        q_rope = tl.load(q_rows + D_MAIN + r[None, :], mask=row_ok[:, None] & (r < D_ROPE)[None, :],
                         other=0.0)
    else:
        q_rope = q  # never read
    if DOT_FP16:
        # e4m3 -> fp16 is one cvt per two elements, e4m3 -> bf16 several; fp16 holds every bf16
        # query of magnitude 2**-14 .. 65504 exactly (more mantissa bits), and P in [0, 1] better.
        # Past 65504 it overflows: a tile whose largest finite element reaches 2**15 is scaled
        # down by a power of two (exact), and the softmax scale up by the same power.
        q32 = q.to(tl.float32)
        largest = tl.max(tl.max(_finite_abs(q32), 1), 0)
        if D_ROPE > 0:
            q_rope32 = q_rope.to(tl.float32)
            largest = tl.maximum(largest, tl.max(tl.max(_finite_abs(q_rope32), 1), 0))
        # floor(log2(largest)) from the fp32 exponent field; 0 when nothing needs scaling.
        shift = tl.maximum(((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - (127 + 14), 0)
        down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2**-shift
        q = (q32 * down).to(tl.float16)
        if D_ROPE > 0:
            q_rope = (q_rope32 * down).to(tl.float16)
        scale = scale * ((127 + shift) << 23).to(tl.float32, bitcast=True)  # x 2**shift
    elif DOT_FP32:
        q = q.to(tl.float32)
        if D_ROPE > 0:
            q_rope = q_rope.to(tl.float32)
    dot_dtype = q.dtype

    if HAS_K_SCALE:
        scale = scale * tl.load(k_scale_ptr)
    if not SOFT_CAP:
        scale = scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    # Steps wholly inside [lo, hi) that every row sees need no mask at all: whole steps below the
    # tile's first query (causal) or anywhere (non-causal). Windows with several tokens per tile
    # take the masked path throughout; the rest of the range (at most a step or two) is masked.
    if TOKENS_PER_TILE > 1 and WINDOW:
        clean_hi = lo
    elif TOKENS_PER_TILE > 1 and CAUSAL:
        first_pos = kv_len - q_len + first_token
        clean_hi = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // BLOCK_N * BLOCK_N
    else:
        clean_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
    # With PREFETCH_PAGES the block-table entries of each step are loaded one step ahead (see
    # _attend_range); the unmasked steps hand the next step's entries to the masked ones.
    page = _load_pages(table_row, stride_bp, lo, hi, BLOCK_N, BLOCK_SIZE, True) if PREFETCH_PAGES else 0
    acc, l_i, m_i, page = _attend_range(
        acc, l_i, m_i, page, lo, clean_hi, q, q_rope, hi, row_pos, window, scale, soft_cap, table_row, stride_bp,
        k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs, dot_dtype, d, r,
        BLOCK_N, D_MAIN, D_ROPE, BLOCK_D, BLOCK_SIZE, False, False, False, SOFT_CAP, V_FROM_K, PREFETCH_PAGES)
    acc, l_i, m_i, page = _attend_range(
        acc, l_i, m_i, page, clean_hi, hi, q, q_rope, hi, row_pos, window, scale, soft_cap, table_row, stride_bp,
        k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs, dot_dtype, d, r,
        BLOCK_N, D_MAIN, D_ROPE, BLOCK_D, BLOCK_SIZE, True, CAUSAL and TOKENS_PER_TILE > 1,
        WINDOW and TOKENS_PER_TILE > 1, SOFT_CAP, V_FROM_K, PREFETCH_PAGES)

    if HAS_V_SCALE:
        acc = acc * tl.load(v_scale_ptr)
    if SPLIT_KV:
        ml_index = (split * num_tokens + token) * NUM_Q_HEADS + row_head
        tl.store(part_ml_ptr + ml_index, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_splits * num_tokens * NUM_Q_HEADS + ml_index, l_i, mask=row_ok)
        tl.store(part_acc_ptr + ml_index[:, None] * D_MAIN + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        denominator = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + row_head * stride_sink, mask=row_ok, other=0.0)
            denominator += tl.exp2(sink * LOG2E - m_use)
        denominator = tl.where(denominator == 0.0, 1.0, denominator)  # rows with nothing visible
        out = acc / denominator[:, None]
        out_rows = out_ptr + token[:, None] * stride_ot + row_head[:, None].to(tl.int64) * stride_oh
        tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            lse = (m_use + tl.log2(l_i)) * LN2
            tl.store(lse_ptr + token * NUM_Q_HEADS + row_head, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [T, Hq, D_MAIN] in q's dtype
    lse_ptr,  # [T, Hq] fp32 (RETURN_LSE)
    part_acc_ptr,  # [num_splits, T, Hq, D_MAIN] fp32
    part_ml_ptr,  # [2, num_splits, T, Hq] fp32
    sinks_ptr,  # [Hq] fp32 (HAS_SINKS)
    num_tokens,
    num_splits,
    stride_ot, stride_oh,
    stride_sink,
    NUM_Q_HEADS: tl.constexpr,
    D_MAIN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next_pow2(num_splits)
    HAS_SINKS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """One (token, query head) per program: rescale each split's partial to the common max and
    divide by the merged sum (plus the sink's term)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    ml_index = (s * num_tokens + token) * NUM_Q_HEADS + head
    m = tl.load(part_ml_ptr + ml_index, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + num_splits * num_tokens * NUM_Q_HEADS + ml_index, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_use)  # 0 for empty splits (m = -inf)
    total = tl.sum(l_s * w, 0)
    denominator = total
    if HAS_SINKS:
        denominator += tl.exp2(tl.load(sinks_ptr + head * stride_sink) * LOG2E - m_use)
    denominator = tl.where(denominator == 0.0, 1.0, denominator)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D_MAIN
    acc = tl.load(part_acc_ptr + ml_index[:, None] * D_MAIN + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denominator
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        tl.store(lse_ptr + token * NUM_Q_HEADS + head, (m_use + tl.log2(total)) * LN2)
