"""The triton backend's ssd_scan kernels: the chunked SSD over packed variable-length sequences, in the launches
ssd_scan.py makes, in order:

- chunk_table_kernel: the chunks of every sequence (chunks restart at each sequence's first token), from
  cu_seqlens on the device: each chunk's sequence and first token, each sequence's first chunk.
- chunk_cumsum_kernel: dt' per token (bias, softplus, clamp) and the running sum of its decay exponent dt' A
  inside its chunk, both fp32 [Hh, chunks, Q]; padding positions get dt' = 0 (decay 1, no input).
- chunk_cb_kernel: C_i . B_j of every token pair of a chunk, per group (shared by its heads), fp32.
- the states entering the chunks (in the dots' dtype, for the scan) and each sequence's final state (fp32), from
  its initial state, by one of two routes (ssd_scan.py picks by how many programs the walk has):
  - state_walk_kernel: a program per (sequence, head, state tile) walks the sequence's chunks, adding each
    chunk's tokens into the state it carries;
  - chunk_state_kernel, each chunk's own contribution to the state at its end, sum_j exp(cs_last - cs_j) dt'_j
    x_j (x) B_j, fp32 [chunks, Hh, P, N], a program per chunk; then state_passing_kernel, sequence by sequence.
- chunk_scan_kernel: y_i = exp(cs_i) C_i . state_in + sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt'_j x_j, with
  D x and the z gate fused.

The dots multiply in the activations' dtype (DOT; fp32 under the interpreter, whose bf16 dots are wrong) into
fp32 accumulators; fp32 operands at PRECISION (3xTF32 on the GPU: one TF32 pass was off by up to 8e-3).
Programs of chunks past the last real one (the grids are sized by a bound, with no host sync) run zero-trip
loops and store nothing. Host side: ssd_scan.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._mamba_kernel import time_step


@triton.jit
def chunk_table_kernel(cu_ptr, first_ptr, seq_ptr, start_ptr, num_seqs, CHUNK: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program s (0..Bs): first_ptr[s] = the chunks of the sequences before s (first_ptr[Bs]: all of them), and for
    s < Bs its chunks' sequence and first token."""
    seq = tl.program_id(0)
    first = seq * 0
    for s0 in range(0, seq, BLOCK_S):
        before = s0 + tl.arange(0, BLOCK_S)
        ok = before < seq
        lengths = tl.load(cu_ptr + before + 1, mask=ok, other=0) - tl.load(cu_ptr + before, mask=ok, other=0)
        first += tl.sum((lengths + CHUNK - 1) // CHUNK)
    tl.store(first_ptr + seq, first)
    lo = tl.load(cu_ptr + seq)
    hi = tl.load(cu_ptr + tl.minimum(seq + 1, num_seqs))  # program Bs: no chunks of its own
    count = (hi - lo + CHUNK - 1) // CHUNK
    for i0 in range(0, count, BLOCK_C):
        i = i0 + tl.arange(0, BLOCK_C)
        ok = i < count
        tl.store(seq_ptr + first + i, seq + tl.zeros_like(i), mask=ok)
        tl.store(start_ptr + first + i, lo + i * CHUNK, mask=ok)


@triton.jit
def chunk_bounds(chunk, first_ptr, seq_ptr, start_ptr, cu_ptr, num_seqs, CHUNK: tl.constexpr):
    """(sequence, first token as int64, length) of chunk ``chunk``; length 0 past the last chunk (its table
    entries are never written: they are not trusted)."""
    alive = chunk < tl.load(first_ptr + num_seqs)
    seq = tl.where(alive, tl.load(seq_ptr + chunk), 0)
    start = tl.where(alive, tl.load(start_ptr + chunk), 0)
    length = tl.where(alive, tl.minimum(tl.load(cu_ptr + seq + 1) - start, CHUNK), 0)
    return seq, start.to(tl.int64), length


@triton.jit
def chunk_cumsum_kernel(dt_ptr, a_ptr, bias_ptr, first_ptr, seq_ptr, start_ptr, cu_ptr, step_ptr, cum_ptr,
                        num_seqs, num_heads, dt_min, dt_max, stride_tt, stride_th, stride_a, stride_bias,
                        stride_sh, stride_sc, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """A chunk (axis 0) by BLOCK_H heads (axis 1): dt' and its decay exponents' running sum."""
    chunk = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _, start, length = chunk_bounds(chunk, first_ptr, seq_ptr, start_ptr, cu_ptr, num_seqs, CHUNK)
    q = tl.arange(0, CHUNK)
    head_ok = heads < num_heads
    ok = head_ok[:, None] & (q < length)[None, :]
    dt = tl.load(dt_ptr + (start + q)[None, :] * stride_tt + heads[:, None] * stride_th, mask=ok, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + heads * stride_bias, mask=head_ok, other=0.0)[:, None]
    step = tl.where(ok, time_step(dt, bias, HAS_BIAS, SOFTPLUS, dt_min, dt_max, CLAMP), 0.0)
    a = tl.load(a_ptr + heads * stride_a, mask=head_ok, other=0.0)
    cum = tl.cumsum(step * a[:, None], axis=1)
    offsets = heads[:, None] * stride_sh + chunk.to(tl.int64) * stride_sc + q[None, :]
    tl.store(step_ptr + offsets, step, mask=head_ok[:, None])
    tl.store(cum_ptr + offsets, cum, mask=head_ok[:, None])


@triton.jit
def chunk_cb_kernel(b_ptr, c_ptr, first_ptr, seq_ptr, start_ptr, cu_ptr, cb_ptr, num_seqs, state_dim,
                    stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn, stride_kc, stride_kg,
                    DOT: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """A chunk (axis 0), a group (axis 1) and a BLOCK_M x BLOCK_N tile of its Q x Q pairs (axis 2): C_i . B_j,
    for the tiles on or below the diagonal (those above are causally unused and not written)."""
    chunk = tl.program_id(0)
    group = tl.program_id(1)
    tiles_n = tl.cdiv(CHUNK, BLOCK_N)
    i0 = tl.program_id(2) // tiles_n * BLOCK_M
    j0 = tl.program_id(2) % tiles_n * BLOCK_N
    _, start, length = chunk_bounds(chunk, first_ptr, seq_ptr, start_ptr, cu_ptr, num_seqs, CHUNK)
    i = i0 + tl.arange(0, BLOCK_M)
    j = j0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if j0 <= i0 + BLOCK_M - 1:
        for k0 in range(0, state_dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < state_dim
            c = tl.load(c_ptr + (start + i)[:, None] * stride_ct + group * stride_cg + k[None, :] * stride_cn,
                        mask=(i < length)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + (start + j)[None, :] * stride_bt + group * stride_bg + k[:, None] * stride_bn,
                        mask=(j < length)[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(c.to(DOT), b.to(DOT), acc, input_precision=PRECISION)
        tl.store(cb_ptr + chunk.to(tl.int64) * stride_kc + group * stride_kg + i[:, None] * CHUNK + j[None, :], acc,
                 mask=(i < CHUNK)[:, None] & (j < CHUNK)[None, :])


@triton.jit
def state_tile(head_dim, state_dim, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows of P and columns of N of the state tile program_id(2) names, and which lie in the state."""
    tiles_n = tl.cdiv(state_dim, BLOCK_N)
    p = tl.program_id(2) // tiles_n * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.program_id(2) % tiles_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, n, p < head_dim, n < state_dim


@triton.jit
def chunk_state_kernel(x_ptr, b_ptr, step_ptr, cum_ptr, first_ptr, seq_ptr, start_ptr, cu_ptr, states_ptr,
                       num_seqs, head_dim, state_dim, heads_per_group, stride_xt, stride_xh, stride_xp,
                       stride_bt, stride_bg, stride_bn, stride_sh, stride_sc, stride_oc, stride_oh,
                       DOT: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """A chunk (axis 0), a head (axis 1) and a BLOCK_P x BLOCK_N tile of its state (axis 2): the chunk's
    contribution to the state at its end."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    p, n, p_ok, n_ok = state_tile(head_dim, state_dim, BLOCK_P, BLOCK_N)
    _, start, length = chunk_bounds(chunk, first_ptr, seq_ptr, start_ptr, cu_ptr, num_seqs, CHUNK)
    group = head // heads_per_group
    sums = head * stride_sh + chunk.to(tl.int64) * stride_sc
    last = tl.load(cum_ptr + sums + CHUNK - 1)  # padding adds nothing to the running sum
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < length
        x = tl.load(x_ptr + (start + t)[None, :] * stride_xt + head * stride_xh + p[:, None] * stride_xp,
                    mask=p_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_P, BLOCK_T]
        weight = tl.exp(last - tl.load(cum_ptr + sums + t, mask=t_ok, other=0.0)) * \
            tl.load(step_ptr + sums + t, mask=t_ok, other=0.0)
        b = tl.load(b_ptr + (start + t)[:, None] * stride_bt + group * stride_bg + n[None, :] * stride_bn,
                    mask=t_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(x.to(DOT), (b * weight[:, None]).to(DOT), acc, input_precision=PRECISION)
    tl.store(states_ptr + chunk.to(tl.int64) * stride_oc + head * stride_oh + p[:, None] * state_dim + n[None, :],
             acc, mask=p_ok[:, None] & n_ok[None, :])


@triton.jit
def state_passing_kernel(states_ptr, cum_ptr, first_ptr, init_ptr, starts_ptr, final_ptr, head_dim, state_dim,
                         stride_sh, stride_sc, stride_oc, stride_oh, stride_is, stride_ih, stride_ip, stride_in,
                         stride_fs, stride_fh, HAS_INIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """A sequence (axis 0), a head (axis 1) and BLOCK elements of its P x N state (axis 2): the state entering
    each of the sequence's chunks (into starts, laid out as the chunk states), and the final state."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = e < head_dim * state_dim
    if HAS_INIT:
        p = e // state_dim
        n = e % state_dim
        state = tl.load(init_ptr + seq.to(tl.int64) * stride_is + head * stride_ih + p * stride_ip + n * stride_in,
                        mask=ok, other=0.0)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(tl.load(first_ptr + seq), tl.load(first_ptr + seq + 1)):
        chunk64 = tl.cast(chunk, tl.int64)  # a Python int under the interpreter
        offsets = chunk64 * stride_oc + head * stride_oh + e
        tl.store(starts_ptr + offsets, state.to(starts_ptr.dtype.element_ty), mask=ok)
        own = tl.load(states_ptr + offsets, mask=ok, other=0.0)
        state = state * tl.exp(tl.load(cum_ptr + head * stride_sh + chunk64 * stride_sc + CHUNK - 1)) + own
    tl.store(final_ptr + seq.to(tl.int64) * stride_fs + head * stride_fh + e, state, mask=ok)


@triton.jit
def walk_loads(s, steps, lo, hi, first, head, group, n, n_ok, b_ptr, cum_ptr, step_ptr, stride_bt, stride_bg,
               stride_bn, stride_sh, stride_sc, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, STEPS: tl.constexpr):
    """state_walk_kernel's loads for its step s (nothing past the last step): B [BLOCK_T, BLOCK_N], the tokens' running
    sums and dt', and the chunk's total."""
    c = s // STEPS
    chunk = (first + c).to(tl.int64)
    start = (lo + c * CHUNK).to(tl.int64)
    length = tl.where(s < steps, tl.minimum(hi - start, CHUNK), 0)
    t = (s - c * STEPS) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < length
    sums = head * stride_sh + chunk * stride_sc
    b = tl.load(b_ptr + (start + t)[:, None] * stride_bt + group * stride_bg + n[None, :] * stride_bn,
                mask=t_ok[:, None] & n_ok[None, :], other=0.0)
    cum = tl.load(cum_ptr + sums + t, mask=t_ok, other=0.0)
    dt = tl.load(step_ptr + sums + t, mask=t_ok, other=0.0)
    last = tl.load(cum_ptr + sums + CHUNK - 1, mask=length > 0, other=0.0)  # padding adds nothing to the sum
    return b, cum, dt, last


@triton.jit
def state_walk_kernel(x_ptr, b_ptr, step_ptr, cum_ptr, first_ptr, cu_ptr, init_ptr, starts_ptr, final_ptr,
                      head_dim, state_dim, heads_per_group, stride_xt, stride_xh, stride_xp, stride_bt, stride_bg,
                      stride_bn, stride_sh, stride_sc, stride_oc, stride_oh, stride_is, stride_ih, stride_ip,
                      stride_in, stride_fs, stride_fh, HAS_INIT: tl.constexpr, DOT: tl.constexpr,
                      PRECISION: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_T: tl.constexpr, STEPS: tl.constexpr):
    """A sequence (axis 0), a head (axis 1) and a BLOCK_P x BLOCK_N tile of its state (axis 2), walking the
    sequence's chunks in one loop of BLOCK_T-token steps (STEPS a chunk): at a chunk's first step the state
    entering it is stored (into starts, in the dots' dtype) and decayed by the chunk's total; every step adds its
    tokens' x^T (exp(cs_last - cs) dt' B) to it. The final state is stored at the end. The chunks' own
    contributions never reach memory."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p, n, p_ok, n_ok = state_tile(head_dim, state_dim, BLOCK_P, BLOCK_N)
    ok = p_ok[:, None] & n_ok[None, :]
    group = head // heads_per_group
    if HAS_INIT:
        acc = tl.load(init_ptr + seq.to(tl.int64) * stride_is + head * stride_ih + p[:, None] * stride_ip
                      + n[None, :] * stride_in, mask=ok, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    lo = tl.load(cu_ptr + seq)
    hi = tl.load(cu_ptr + seq + 1)
    first = tl.load(first_ptr + seq)
    state_offsets = head * stride_oh + p[:, None] * state_dim + n[None, :]
    steps = (hi - lo + CHUNK - 1) // CHUNK * STEPS
    # B, cs and dt' feed the dot through registers (their product is formed there), where the software pipeline does
    # not prefetch them: each step's are loaded a step ahead, by hand.
    b_next, cum_next, dt_next, last_next = walk_loads(0, steps, lo, hi, first, head, group, n, n_ok, b_ptr, cum_ptr,
                                                      step_ptr, stride_bt, stride_bg, stride_bn, stride_sh, stride_sc,
                                                      CHUNK, BLOCK_T, STEPS)
    for s in range(0, steps):
        c = s // STEPS
        part = s - c * STEPS
        chunk = (first + c).to(tl.int64)
        start = (lo + c * CHUNK).to(tl.int64)
        length = tl.minimum(hi - start, CHUNK)
        b, cum_t, dt_t, last = b_next, cum_next, dt_next, last_next
        b_next, cum_next, dt_next, last_next = walk_loads(s + 1, steps, lo, hi, first, head, group, n, n_ok, b_ptr,
                                                          cum_ptr, step_ptr, stride_bt, stride_bg, stride_bn, stride_sh,
                                                          stride_sc, CHUNK, BLOCK_T, STEPS)
        entering = part == 0
        tl.store(starts_ptr + chunk * stride_oc + state_offsets, acc.to(starts_ptr.dtype.element_ty),
                 mask=(p < tl.where(entering, head_dim, 0))[:, None] & n_ok[None, :])
        acc = acc * tl.where(entering, tl.exp(last), 1.0)
        t = part * BLOCK_T + tl.arange(0, BLOCK_T)
        x = tl.load(x_ptr + (start + t)[None, :] * stride_xt + head * stride_xh + p[:, None] * stride_xp,
                    mask=p_ok[:, None] & (t < length)[None, :], other=0.0)  # [BLOCK_P, BLOCK_T]
        weight = tl.exp(last - cum_t) * dt_t
        acc = tl.dot(x.to(DOT), (b.to(tl.float32) * weight[:, None]).to(DOT), acc, input_precision=PRECISION)
    tl.store(final_ptr + seq.to(tl.int64) * stride_fs + head * stride_fh + p[:, None] * state_dim + n[None, :], acc,
             mask=ok)


@triton.jit
def exp_approx(x, FAST: tl.constexpr):
    """exp(x) in fp32; FAST (the GPU): one ex2.approx.ftz after the multiply by log2(e), where tl.exp wraps the same
    two instructions in a denormal fix-up (2 ulp; results below 2^-126 flush to 0: a decay that small changes no
    sum it enters, and a gate's exp(-z) that large leaves z sigmoid(z) at 0 either way)."""
    if FAST:
        return tl.inline_asm_elementwise(asm="ex2.approx.ftz.f32 $0, $1;", constraints="=r,r",
                                         args=[x * 1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def chunk_scan_kernel(x_ptr, c_ptr, d_ptr, z_ptr, step_ptr, cum_ptr, cb_ptr, starts_ptr, first_ptr, seq_ptr,
                      start_ptr, cu_ptr, y_ptr, num_seqs, head_dim, state_dim, heads_per_group,
                      stride_xt, stride_xh, stride_xp, stride_ct, stride_cg, stride_cn, stride_d,
                      stride_zt, stride_zh, stride_zp, stride_yt, stride_yh, stride_yp, stride_sh, stride_sc,
                      stride_kc, stride_kg, stride_oc, stride_oh,
                      HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                      CHUNK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
                      FAST: tl.constexpr):
    """A chunk (axis 0), a head (axis 1) and BLOCK_M tokens x BLOCK_P of P (axis 2): y, from the state entering
    the chunk and the chunk's earlier tokens, with D x and the gate. FAST: the elementwise exponentials and the
    gate's division approximate (exp_approx)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    tiles_p = tl.cdiv(head_dim, BLOCK_P)
    i0 = tl.program_id(2) // tiles_p * BLOCK_M
    i = i0 + tl.arange(0, BLOCK_M)
    p = tl.program_id(2) % tiles_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < head_dim
    _, start, length = chunk_bounds(chunk, first_ptr, seq_ptr, start_ptr, cu_ptr, num_seqs, CHUNK)
    i_ok = i < length
    group = head // heads_per_group
    sums = head * stride_sh + chunk.to(tl.int64) * stride_sc
    cum_i = tl.load(cum_ptr + sums + i, mask=i < CHUNK, other=0.0)

    live = i0 < length  # no tokens of this tile in the chunk: nothing to read

    # The state entering the chunk, read out by C_i (its decay to token i, exp(cs_i), applied below).
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    starts = starts_ptr + chunk.to(tl.int64) * stride_oc + head * stride_oh
    for k0 in range(0, tl.where(live, state_dim, 0), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < state_dim
        c = tl.load(c_ptr + (start + i)[:, None] * stride_ct + group * stride_cg + k[None, :] * stride_cn,
                    mask=i_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.load(starts + p[None, :] * state_dim + k[:, None], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        acc = tl.dot(c.to(DOT), s.to(DOT), acc, input_precision=PRECISION)

    # The chunk's tokens before the tile's first row i0, in whole steps (BLOCK_J divides BLOCK_M): every j < i, so no
    # causal mask, and exp(cs_i - cs_j) = exp(cs_i - cs_i0) exp(cs_i0 - cs_j), both at most 1 (the running sums
    # never rise): the columns' factor scales the C.B tile, the rows' the accumulator once after these steps, with
    # the state's (exp(cs_i) = exp(cs_i0) exp(cs_i - cs_i0)). A step costs a multiply an element, not a mask and an
    # exponential.
    cbs = cb_ptr + chunk.to(tl.int64) * stride_kc + group * stride_kg
    ref = tl.load(cum_ptr + sums + i0)
    acc *= tl.exp(ref)
    for j0 in range(0, tl.where(live, i0, 0), BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        cb = tl.load(cbs + i[:, None] * CHUNK + j[None, :])  # j < i0 < length: rows and tokens in the chunk
        weight = tl.exp(ref - tl.load(cum_ptr + sums + j)) * tl.load(step_ptr + sums + j)
        x = tl.load(x_ptr + (start + j)[:, None] * stride_xt + head * stride_xh + p[None, :] * stride_xp,
                    mask=p_ok[None, :], other=0.0)
        acc = tl.dot((cb * weight[None, :]).to(DOT), x.to(DOT), acc, input_precision=PRECISION)
    acc *= tl.exp(cum_i - ref)[:, None]

    # The tokens from i0 on, masked by the causal triangle.
    for j0 in range(i0, tl.where(live, tl.minimum(length, i0 + BLOCK_M), 0), BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < length
        causal = (i[:, None] >= j[None, :]) & j_ok[None, :]
        # chunk_cb writes every entry of the chunk's Q x Q, finite (zeros past its length), and the decay below is
        # 0 off the causal triangle: tiles that lie within Q load whole vectors, unmasked.
        if (CHUNK % BLOCK_M == 0) and (CHUNK % BLOCK_J == 0):
            cb = tl.load(cbs + i[:, None] * CHUNK + j[None, :])
        else:
            cb = tl.load(cbs + i[:, None] * CHUNK + j[None, :], mask=(i < CHUNK)[:, None] & j_ok[None, :], other=0.0)
        cum_j = tl.load(cum_ptr + sums + j, mask=j_ok, other=0.0)
        step_j = tl.load(step_ptr + sums + j, mask=j_ok, other=0.0)
        decay = exp_approx(tl.where(causal, cum_i[:, None] - cum_j[None, :], float("-inf")), FAST)
        scores = cb * decay * step_j[None, :]
        x = tl.load(x_ptr + (start + j)[:, None] * stride_xt + head * stride_xh + p[None, :] * stride_xp,
                    mask=j_ok[:, None] & p_ok[None, :], other=0.0)
        acc = tl.dot(scores.to(DOT), x.to(DOT), acc, input_precision=PRECISION)

    ok = i_ok[:, None] & p_ok[None, :]
    tokens = (start + i)[:, None]
    if HAS_D:
        x_i = tl.load(x_ptr + tokens * stride_xt + head * stride_xh + p[None, :] * stride_xp, mask=ok, other=0.0)
        acc += tl.load(d_ptr + head * stride_d).to(tl.float32) * x_i.to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + tokens * stride_zt + head * stride_zh + p[None, :] * stride_zp, mask=ok,
                    other=0.0).to(tl.float32)
        acc *= tl.fdiv(z, 1.0 + exp_approx(-z, FAST), ieee_rounding=not FAST)  # z sigmoid(z)
    tl.store(y_ptr + tokens * stride_yt + head * stride_yh + p[None, :] * stride_yp,
             acc.to(y_ptr.dtype.element_ty), mask=ok)
