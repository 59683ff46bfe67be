"""The gather-then-flash routine behind the cpu backend's paged_attention and mla_decode: chunks of
sequences gathered into reused buffers, GQA heads packed as rows, torch's fused CPU flash attention."""

# The references loop over sequences, expand every KV head to its query heads, convert the whole
# gathered KV to fp32 and run two einsums. paged_attend instead:
#
# - batches sequences of equal query length into chunks, sorted by KV length so padding stays
#   small, whose gathered KV stays under ``_CHUNK_BYTES``, and gathers every chunk into the same
#   buffers (fresh memory is page-faulted in on every use: a 64 MB index_select took 3.5 ms into
#   reused memory, 19 ms into fresh, on a 2-core AVX-512 VM, perf/decisions/paged_attention.md);
# - packs a KV head's query heads (and its queries) into the rows of one attention problem, so each
#   gathered KV row is read by all the heads that share it, with no copy per query head;
# - runs torch's fused CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``:
#   bf16/fp16 inputs, fp32 accumulation, online softmax, and the log-sum-exp needed for sinks and
#   for mla_decode's ``lse``) on the gathered KV in the cache's own layout;
# - keeps fp8 caches exact: e4m3 codes convert exactly to fp16/bf16 (through the vectorized route
#   of ``_fp8``) and the per-tensor scales fold into the softmax scale (K) and the output (V).
#
# A soft cap cannot go through the fused kernel (it caps the scores inside the softmax), so those
# calls take an fp32 matmul path, a sequence a chunk (``_SOFT_CAP_CHUNK_BYTES``).

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kernelmux.backends.cpu._fp8 import FP8, FP8_ROUTE_SCALE, fp8_to_half_scaled

__all__ = ["paged_attend"]

# Gathered K (and V) bytes per chunk: large enough that the per-chunk overhead (~50 us of small
# ops) is noise, small enough that a chunk's KV stays in the last-level cache between the gather
# and the attention that reads it.
_CHUNK_BYTES = 8 << 20
# The soft cap's fp32 path converts each chunk's gathered KV to fp32 in fresh memory, padded to the chunk's
# longest sequence: one sequence a chunk pays less for that than it adds in calls (gemma2_soft_cap on the 2-core
# VM: 2.9-3.2 ms against 5.6-7.1 ms in 8 MiB chunks, the reference 6.5).
_SOFT_CAP_CHUNK_BYTES = 0

_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class _Sequence(NamedTuple):
    index: int  # b
    start: int  # first query row
    q_len: int
    kv_len: int


def _chunks(sequences: list[_Sequence], row_bytes: int, budget: int) -> list[list[_Sequence]]:
    """Group sequences of equal q_len, sorted by kv_len, into chunks whose padded gathered KV
    stays under ``budget`` bytes (a sequence larger than the budget is a chunk of its own).
    Equal q_len means no padded queries: a 64-query prefill never pads to a 300-query one."""
    chunks: list[list[_Sequence]] = []
    current: list[_Sequence] = []
    for seq in sorted(sequences, key=lambda s: (s.q_len, s.kv_len)):
        # Sorted ascending, so the newest member has the chunk's largest kv_len.
        if current and (
            seq.q_len != current[0].q_len
            or (len(current) + 1) * seq.kv_len * row_bytes > budget
        ):
            chunks.append(current)
            current = []
        current.append(seq)
    if current:
        chunks.append(current)
    return chunks


class _Gatherer:
    """Gathers chunks of one cache, each into the same buffers."""

    def __init__(self, cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype, max_rows: int):
        self.cache, self.block_table = cache, block_table
        shape = (max_rows, *cache.shape[2:])
        self.codes = cache.new_empty(shape)
        self.rows = self.codes if cache.dtype == dtype else cache.new_empty(shape, dtype=dtype)
        self.scratch = cache.new_empty(shape, dtype=torch.int16) if cache.dtype == FP8 else None

    def __call__(self, chunk: list[_Sequence], num_blocks: int) -> torch.Tensor:
        """``[n, P, ...]``: the chunk's KV rows in position order, ``P = num_blocks *
        block_size``, in the buffers' dtype (fp8 codes times 2^-8, see _fp8); positions past each
        sequence's length are zero (the cache may hold NaN there)."""
        block_size = self.cache.shape[1]
        ids = self.block_table[[s.index for s in chunk], :num_blocks].long()
        # Entries past a sequence's last block may hold anything, out-of-range ids included.
        needed = torch.tensor([-(-s.kv_len // block_size) for s in chunk])
        ids = ids.masked_fill(torch.arange(num_blocks)[None, :] >= needed[:, None], 0).flatten()
        count = ids.numel() * block_size
        codes = self.codes[:count].view(ids.numel(), *self.cache.shape[1:])
        torch.index_select(self.cache, 0, ids, out=codes)
        rows = self.rows[:count]
        if self.scratch is not None:
            fp8_to_half_scaled(codes, rows, self.scratch[:count])
        rows = rows.view(len(chunk), num_blocks * block_size, *self.cache.shape[2:])
        for i, seq in enumerate(chunk):
            if seq.kv_len < rows.shape[1]:
                rows[i, seq.kv_len :].zero_()
        return rows


def _visible(chunk: list[_Sequence], width: int, causal: bool, window: int) -> torch.Tensor:
    """``[n, q_len or 1, width]`` bool: may query i of each sequence see kv position j (one row
    for all queries when the mask does not depend on the query's position)."""
    q_len = chunk[0].q_len
    kv_len = torch.tensor([s.kv_len for s in chunk])[:, None, None]
    j = torch.arange(width)[None, None, :]
    position = kv_len - q_len + torch.arange(q_len)[None, :, None]
    visible = j < kv_len
    if causal:
        visible = visible & (j <= position)
    if window > 0:
        visible = visible & (j > position - window)
    return visible


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
    soft_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, Hk, M, D]`` over ``k, v [n, P, Hk, D]`` (the gathered layout) with
    ``visible [n, 1, M or 1, P]`` -> ``(out [n, Hk, M, D]`` in q's dtype, ``lse [n, Hk, M]``
    fp32)."""
    if soft_cap > 0:
        # One converting copy each, straight into the [n, Hk, P, D] layout the matmuls want
        # (matmul on a strided fp32 view copies it again first).
        k, v = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (k, v))
        scores = torch.matmul(q.float(), k.transpose(-1, -2)).mul_(scale)
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
        scores = scores.masked_fill_(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(lse[..., None]).exp_()
        return torch.matmul(probs, v).to(q.dtype), lse
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    # The kernel takes the additive mask in q's dtype, broadcast over heads and (stride 0) rows,
    # and K and V as strided [n, Hk, P, D] views of the gathered rows.
    bias = bias.expand(q.shape[0], 1, q.shape[2], k.shape[1])
    out, lse = _flash_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)
    return out, lse


def paged_attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    value_width: Optional[int] = None,
    want_lse: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Paged attention of ``query [T, Hq, D]`` over ``k_cache [N, bs, Hkv, D]`` (or
    ``[N, bs, D]``, one head) and ``v_cache`` like it, or None when the values are the first
    ``value_width`` dims of the keys (MLA's latent rows).

    Returns ``(out [T, Hq, Dv]`` in query's dtype, ``lse [T, Hq]`` fp32 or None). The lse is of
    the scaled (and capped) scores, without the sinks.
    """
    num_tokens, num_heads, head_dim = query.shape
    if k_cache.dim() == 3:  # MLA: one kv head
        k_cache = k_cache.unsqueeze(2)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    value_width = head_dim if value_width is None else value_width
    dtype = query.dtype
    out = torch.zeros((num_tokens, num_heads, value_width), dtype=dtype)
    lse_out = torch.zeros((num_tokens, num_heads), dtype=torch.float32) if want_lse else None
    # Fold the per-tensor fp8 scales (and the 2^8 of the exact fp8 route) into the softmax scale
    # (keys) and the output (values): exact, and no dequantized copy of the cache.
    k_factor = float(k_scale) if k_scale is not None else 1.0
    v_factor = float(v_scale) if v_scale is not None else 1.0
    if k_cache.dtype == FP8:
        k_factor, v_factor = k_factor * FP8_ROUTE_SCALE, v_factor * FP8_ROUTE_SCALE
    scale = scale * k_factor
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    sequences = [
        _Sequence(b, starts[b], starts[b + 1] - starts[b], kv_len)
        for b, kv_len in enumerate(seq_lens.tolist())
        # No queries: nothing to compute. No keys (only possible without causal): the output
        # is the empty sum, zero, as out already holds.
        if starts[b + 1] > starts[b] and kv_len > 0
    ]
    row_bytes = num_kv_heads * head_dim * dtype.itemsize * (1 if v_cache is None else 2)
    chunks = _chunks(sequences, row_bytes, _SOFT_CAP_CHUNK_BYTES if soft_cap > 0 else _CHUNK_BYTES)
    max_rows = max((len(c) * -(-c[-1].kv_len // block_size) * block_size for c in chunks), default=0)
    gather_k = _Gatherer(k_cache, block_table, dtype, max_rows)
    gather_v = None if v_cache is None else _Gatherer(v_cache, block_table, dtype, max_rows)
    for chunk in chunks:
        n, q_len = len(chunk), chunk[0].q_len
        num_blocks = -(-chunk[-1].kv_len // block_size)
        width = num_blocks * block_size
        k = gather_k(chunk, num_blocks)  # [n, P, Hkv, D]
        v = k if gather_v is None else gather_v(chunk, num_blocks)
        # Queries [n, q_len, Hkv, G, D] -> [n, Hkv, q_len * G, D]: row i * G + g.
        rows = torch.cat([torch.arange(s.start, s.start + q_len) for s in chunk])
        q = query.index_select(0, rows).view(n, q_len, num_kv_heads, group, head_dim).transpose(1, 2)
        q = q.reshape(n, num_kv_heads, q_len * group, head_dim)
        visible = _visible(chunk, width, causal, window)
        # Rows i * G + g share query i's mask; a single mask row broadcasts over all rows.
        visible = visible.repeat_interleave(group, dim=1) if visible.shape[1] > 1 else visible
        o, lse = _attend(q, k, v, visible[:, None], scale, soft_cap)
        o = o.view(n, num_kv_heads, q_len, group, head_dim)[..., :value_width]
        lse = lse.view(n, num_kv_heads, q_len, group)
        if sinks is not None:
            # A sink joins the denominator only: out * S / (S + exp(sink)) = out * sigmoid(lse - sink).
            sink = sinks.float().view(num_kv_heads, 1, group)
            o = o.float().mul_(torch.sigmoid(lse - sink)[..., None])
        if v_factor != 1.0:
            o = o.float().mul_(v_factor)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(n * q_len, num_heads, value_width).to(dtype))
        if lse_out is not None:
            lse_out.index_copy_(0, rows, lse.transpose(1, 2).reshape(n * q_len, num_heads))
    return out, lse_out
