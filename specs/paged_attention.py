"""paged_attention: varlen prefill and decode attention over vLLM's paged NHD KV cache (GQA, causal,
sliding window, soft cap, sinks, fp8 caches); the spec, its reference and its cases."""

import itertools
from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import enforce, paged_batch_rules
from kernelmux.specs._compare import assert_close, assert_same_kind
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, drawn, shapes_strategy
from kernelmux.specs._tolerance import ATTENTION_OUTPUT
from kernelmux.specs._validate import check_float, check_int, check_paged_batch, check_tensor
from kernelmux.specs.kv_cache_write import FP8, check_scale, random_cache

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "paged_attention"]

NAME = "paged_attention"
QUERY_DTYPES = (torch.bfloat16, torch.float16)


def _dequantize(cache: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    cache = cache.float()
    return cache * scale.float().reshape(()) if scale is not None else cache


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of each sequence's new queries over its whole cached KV (prefill, chunked prefill
    and decode in one varlen batch).

    Args:
        query: ``[T, Hq, D]`` bf16/fp16; sequence ``b``'s ``q_len_b`` queries are rows
            ``cu_seqlens_q[b] : cu_seqlens_q[b+1]``.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` (vLLM's NHD layout), the query's dtype or
            float8_e4m3fn. ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq / Hkv)``.
        v_cache: like ``k_cache`` (same shape and dtype).
        cu_seqlens_q: ``[B+1]`` int32, ``0 = cu[0] <= cu[1] <= ... <= cu[B] = T``.
        block_table: ``[B, max_blocks]`` int32; sequence ``b``'s kv position ``j`` lives in block
            ``block_table[b, j // block_size]`` at offset ``j % block_size``. Only the first
            ``ceil(seq_lens[b] / block_size)`` entries of a row are read; the rest may hold anything.
            Block ids need not be ordered or distinct across rows (prefix caching shares blocks).
        seq_lens: ``[B]`` int32, the full KV length ``L_b`` including this step's tokens (already
            written by kv_cache_write); ``q_len_b <= L_b`` when ``causal``.
        max_query_len: host int, at least every ``q_len_b`` (decode is ``max_query_len == 1``).
        max_seq_len: host int, at least every ``L_b``.
        scale: multiplies ``q . k`` (usually ``D ** -0.5``).
        causal: query ``i`` of sequence ``b`` sits at kv position ``p = L_b - q_len_b + i`` and
            sees positions ``<= p``; when False every query sees all ``L_b`` positions.
        sliding_window: ``W > 0``: a query at ``p`` sees only ``p - W + 1 .. p`` (the last W
            positions, self included; vLLM's ``sliding_window``, FlashAttention's
            ``window_size = (W - 1, 0)``, FlashInfer's ``window_left = W - 1``). ``0`` = no
            window; requires ``causal``. (An int rather than ``Optional[int]``: the op's parameter
            types are kept to Tensor, Optional[Tensor], int, float, bool, str.)
        logits_soft_cap: ``c > 0``: scores ``s = c * tanh(s / c)`` after ``scale`` and before the
            mask; ``0.0`` = no cap (FlashInfer's convention).
        sinks: ``[Hq]`` fp32 or None: a per-head logit that joins each softmax denominator (and
            only it): ``p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))``. Not scaled or capped.
        k_scale: fp32 tensor of one element, or None (= 1.0); fp8 caches only: key = code * k_scale.
        v_scale: the same for the values.

    Returns:
        ``[T, Hq, D]`` in the query's dtype; ``softmax(s) @ v`` per query and head, computed in fp32.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    out = torch.zeros(query.shape, dtype=query.dtype, device=device)  # contiguous, like fake()
    starts = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    for b, kv_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        # [blocks, block_size, Hkv, D] -> [kv_len, Hq, D]: positions in order, heads expanded.
        k = _dequantize(k_cache[blocks], k_scale).flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        v = _dequantize(v_cache[blocks], v_scale).flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        position = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # [q_len, 1]
        kv_position = torch.arange(kv_len, device=device)[None, :]  # [1, kv_len]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        if causal:
            visible &= kv_position <= position
        if sliding_window > 0:
            visible &= kv_position > position - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :kv_len]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class Key(NamedTuple):
    """paged_attention's dispatch key: what an implementation may decide on (OpSpec.key).
    Sizes that change per batch are classes (``size_class``); ``max_query_len_class <= 1`` is a
    decode batch (one query per sequence at most). ``uniform_queries``: T == B * max_query_len
    (host ints), which proves every sequence has max_query_len queries, since none has more."""

    device: torch.device
    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens_class: int
    num_seqs_class: int
    max_query_len_class: int
    max_seq_len_class: int  # the longest context (host int): not read by kernels, it buckets tuning tables
    uniform_queries: bool
    scale: float
    causal: bool
    sliding_window: int
    logits_soft_cap: float
    query_layout: Layout
    k_cache_layout: Layout
    v_cache_layout: Layout
    same_kv_strides: bool  # k_cache.stride() == v_cache.stride(): kernels that address both with one set may serve
    cu_seqlens_q_layout: Layout
    block_table_layout: Layout
    seq_lens_layout: Layout
    sinks_layout: Optional[Layout]  # None: no sinks
    k_scale_layout: Optional[Layout]  # None: no scale (1.0)
    v_scale_layout: Optional[Layout]

    @property
    def decode(self) -> bool:
        return self.max_query_len_class <= 1


def validate(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Key:
    """Check a call against the spec; return the dispatch key. Reads metadata only: the contents
    of cu_seqlens_q, block_table and seq_lens are device data and stay unchecked."""
    check_tensor(NAME, "query", query, dtypes=QUERY_DTYPES, rank=3)
    device = query.device  # read once: building a torch.device costs ~0.3 us
    num_heads, head_dim = query.shape[1], query.shape[2]
    check_tensor(NAME, "k_cache", k_cache, dtypes=(query.dtype, FP8), rank=4, device=device)
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise InvalidArgumentError(
            NAME, "k_cache", f"head dim D = {head_dim} (query.shape[2]) in k_cache.shape[3]",
            tuple(k_cache.shape),
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            NAME, "k_cache", f"a kv head count Hkv = k_cache.shape[2] dividing Hq = query.shape[1] "
            f"= {num_heads}", num_kv_heads,
        )
    check_tensor(NAME, "v_cache", v_cache, dtypes=(k_cache.dtype,), rank=4, device=device)
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(NAME, "v_cache", f"shape {tuple(k_cache.shape)} (k_cache's)",
                                   tuple(v_cache.shape))
    check_paged_batch(
        NAME, cu_seqlens_q, block_table, seq_lens, max_query_len, max_seq_len, scale, device
    )
    if type(causal) is not bool:
        raise InvalidArgumentError(NAME, "causal", "a bool", type(causal).__name__)
    check_int(NAME, "sliding_window", sliding_window, low=0)
    if sliding_window and not causal:
        raise InvalidArgumentError(
            NAME, "sliding_window", "0 (no window) when causal=False (a window is defined as the "
            "last W positions up to the query's own)", sliding_window,
        )
    check_float(NAME, "logits_soft_cap", logits_soft_cap, low=0.0)  # 0.0 = no cap
    if sinks is not None:
        check_tensor(NAME, "sinks", sinks, dtypes=(torch.float32,), rank=1, device=device)
        if sinks.shape[0] != num_heads:
            raise InvalidArgumentError(NAME, "sinks", f"shape ({num_heads},) (one per query head)",
                                       tuple(sinks.shape))
    check_scale(NAME, "k_scale", k_scale, k_cache.dtype, device)
    check_scale(NAME, "v_scale", v_scale, k_cache.dtype, device)
    return Key(
        device=device, query_dtype=query.dtype, cache_dtype=k_cache.dtype, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=k_cache.shape[1],
        num_tokens_class=size_class(query.shape[0]), num_seqs_class=size_class(seq_lens.shape[0]),
        max_query_len_class=size_class(max_query_len), max_seq_len_class=size_class(max_seq_len),
        uniform_queries=query.shape[0] == seq_lens.shape[0] * max_query_len, scale=scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, query_layout=layout(query),
        k_cache_layout=layout(k_cache), v_cache_layout=layout(v_cache),
        same_kv_strides=k_cache.stride() == v_cache.stride(), cu_seqlens_q_layout=layout(cu_seqlens_q),
        block_table_layout=layout(block_table), seq_lens_layout=layout(seq_lens), sinks_layout=layout(sinks),
        k_scale_layout=layout(k_scale), v_scale_layout=layout(v_scale),
    )


def check_data(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Checked mode: the batch description's contents against the queries and the cache."""
    enforce(NAME, paged_batch_rules(cu_seqlens_q, block_table, seq_lens, query.shape[0], max_query_len,
                                    max_seq_len, k_cache.shape[1], k_cache.shape[0], causal))


def fake(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


# The attention output table, justified in specs/_tolerance.py.
TOLERANCE = ATTENTION_OUTPUT


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    assert_same_kind(actual, expected, NAME)
    assert_close(actual, expected, TOLERANCE[kwargs["query"].dtype], f"{NAME} output [T, Hq, D]")


def _visible_pairs(q_len: int, kv_len: int, causal: bool, window: int) -> tuple[int, int]:
    """(query-key pairs attended, distinct kv positions read) for one sequence."""
    if q_len == 0 or kv_len == 0:
        return 0, 0
    position = torch.arange(kv_len - q_len, kv_len, dtype=torch.int64)
    high = position if causal else torch.full_like(position, kv_len - 1)
    low = (position - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(position)
    pairs = int((high - low + 1).clamp_min(0).sum())
    return pairs, int(high.max() - low.min() + 1)


def cost(kwargs: Mapping[str, Any]) -> Cost:
    query, k_cache = kwargs["query"], kwargs["k_cache"]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    starts = kwargs["cu_seqlens_q"].tolist()
    pairs = positions = 0
    for b, kv_len in enumerate(kwargs["seq_lens"].tolist()):
        p, n = _visible_pairs(starts[b + 1] - starts[b], kv_len, kwargs["causal"], kwargs["sliding_window"])
        pairs, positions = pairs + p, positions + n
    # Two matmuls (QK^T and PV) of 2 * D flops per visible query-key pair and head; softmax, cap
    # and masking are O(pairs) and left out, as attention FLOP counts conventionally do.
    flops = 4 * head_dim * num_heads * pairs
    metadata = sum(kwargs[n].numel() * kwargs[n].element_size() for n in ("cu_seqlens_q", "seq_lens"))
    table = sum(-(-L // k_cache.shape[1]) for L in kwargs["seq_lens"].tolist()) * 4
    extras = sum(t.numel() * t.element_size() for t in (kwargs["sinks"], kwargs["k_scale"], kwargs["v_scale"])
                 if t is not None)
    bytes_moved = (
        2 * query.numel() * query.element_size()  # queries in, outputs out
        + 2 * positions * num_kv_heads * head_dim * k_cache.element_size()  # each visible K and V row once
        + metadata + table + extras
    )
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases. Caches are random everywhere (unused blocks, the tail of each sequence's last block),
# block ids are a random permutation (non-monotonic, scattered) and block-table rows carry unused
# trailing entries pointing at other random blocks, so reading a wrong slot changes the output.


def _maker(
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: Optional[torch.dtype] = None,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    with_sinks: bool = False,
    scales: Optional[tuple[float, float]] = None,
    scale: Optional[float] = None,
    table_slack: int = 2,
    spare_blocks: int = 3,
    shared_prefix_blocks: int = 0,
):
    """Sequences ``b`` with ``q_lens[b]`` queries over ``kv_lens[b]`` cached positions.

    ``shared_prefix_blocks``: every sequence's first blocks are the same physical blocks (prefix
    caching). ``scale`` defaults to ``D ** -0.5``.
    """
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"{NAME}: q_lens and kv_lens differ in length")
    if causal and any(q > kv for q, kv in zip(q_lens, kv_lens)):
        raise ValueError(f"{NAME}: a causal sequence needs q_len <= kv_len")
    cache_dtype = cache_dtype or dtype
    softmax_scale = head_dim**-0.5 if scale is None else scale

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        needed = [-(-kv // block_size) for kv in kv_lens]
        shared = min([shared_prefix_blocks, *needed]) if needed else 0
        own = sum(n - shared for n in needed)
        num_blocks = shared + own + spare_blocks
        ids = torch.randperm(num_blocks, generator=generator)
        prefix, rest = ids[:shared], ids[shared:]
        max_blocks = max(needed, default=0) + table_slack
        # Unused entries: random valid ids (they point at random data, never at padding zeros).
        table = torch.randint(0, num_blocks, (len(kv_lens), max_blocks), generator=generator)
        taken = 0
        for b, n in enumerate(needed):
            table[b, :shared] = prefix
            table[b, shared:n] = rest[taken : taken + n - shared]
            taken += n - shared
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)])
        kwargs = {
            "query": torch.randn(sum(q_lens), num_heads, head_dim, generator=generator, dtype=dtype),
            "k_cache": random_cache(cache_shape, cache_dtype, generator),
            "v_cache": random_cache(cache_shape, cache_dtype, generator),
            "cu_seqlens_q": cu.to(torch.int32),
            "block_table": table.to(torch.int32),
            "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
            "max_query_len": max(q_lens, default=0),
            "max_seq_len": max(kv_lens, default=0),
            "scale": softmax_scale,
            "causal": causal,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            # gpt-oss's learned sinks are O(1) logits, comparable to the scores.
            "sinks": torch.randn(num_heads, generator=generator) * 2 if with_sinks else None,
            "k_scale": None,
            "v_scale": None,
        }
        if scales is not None:
            kwargs["k_scale"] = torch.tensor(scales[0], dtype=torch.float32)
            kwargs["v_scale"] = torch.tensor([scales[1]], dtype=torch.float32)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _decode(batch: int, context: int, num_heads: int, num_kv_heads: int, **options: Any):
    return _maker((1,) * batch, (context,) * batch, num_heads, num_kv_heads, 128, **options)


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    rand, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    gpu = frozenset({"model", "gpu"})
    scaled = "; the gpu-tagged cases scale the grid up"
    return (
        # Llama-3-8B: 32 q / 8 kv heads, D 128; Llama-3-70B at TP8: 8 / 1. Block size 16.
        Case("llama3_8b_decode_b8_ctx4096", _decode(8, 4096, 32, 8), model,
             "Llama-3-8B decode, B 8 x context 4096 (GQA group 4)" + scaled),
        Case("llama3_8b_decode_b64_ctx512", _decode(64, 512, 32, 8), model,
             "Llama-3-8B decode, B 64 x context 512: many short sequences" + scaled),
        Case("llama3_70b_tp8_decode_b8_ctx4096", _decode(8, 4096, 8, 1), quick,
             "Llama-3-70B at TP8 decode (8 q heads sharing 1 kv head), B 8 x 4096" + scaled),
        Case("llama3_70b_tp8_decode_b1_ctx32768", _decode(1, 32768, 8, 1), quick,
             "Llama-3-70B at TP8 decode of one 32768-token context: one long split-KV sequence"),
        # The perf goals' shapes (GB-sized caches: accelerators only).
        Case("llama3_8b_decode_b64_ctx4096", _decode(64, 4096, 32, 8), gpu,
             "Llama-3-8B decode, B 64 x context 4096: a 1 GiB bf16 cache (perf goal)"),
        Case("llama3_70b_tp8_decode_b64_ctx4096", _decode(64, 4096, 8, 1), gpu,
             "Llama-3-70B at TP8 decode, B 64 x 4096 (perf goal)"),
        Case("llama3_70b_tp8_decode_b8_ctx32768", _decode(8, 32768, 8, 1), gpu,
             "Llama-3-70B at TP8 decode, B 8 x 32768: few long sequences, split-KV (perf goal)"),
        Case("llama3_8b_fp8_decode_b64_ctx4096",
             _decode(64, 4096, 32, 8, cache_dtype=FP8, scales=(0.23, 0.31)),
             gpu, "Llama-3-8B decode with an fp8 cache, B 64 x 4096 (perf goal)"),
        Case("llama3_70b_tp8_fp8_decode_b64_ctx4096",
             _decode(64, 4096, 8, 1, cache_dtype=FP8, scales=(0.23, 0.31)), gpu,
             "Llama-3-70B at TP8 decode with an fp8 cache, B 64 x 4096 (perf goal)"),
        Case("llama3_70b_tp8_fp8_decode_b8_ctx32768",
             _decode(8, 32768, 8, 1, cache_dtype=FP8, scales=(0.23, 0.31)), gpu,
             "Llama-3-70B at TP8 decode with an fp8 cache, B 8 x 32768 (perf goal)"),
        Case("llama3_8b_prefill_t8192", _maker((8192,), (8192,), 32, 8, 128), gpu,
             "Llama-3-8B causal prefill of one 8192-token prompt (perf goal)"),
        Case("llama3_8b_prefill_t1024", _maker((1024,), (1024,), 32, 8, 128), model,
             "Llama-3-8B prefill of one 1024-token prompt, causal (q_len = seq_len)" + scaled),
        Case("llama3_8b_prefill_t1024_4seqs", _maker((512, 256, 192, 64), (512, 256, 192, 64), 32, 8, 128),
             quick, "Llama-3-8B varlen prefill: 1024 tokens in 4 prompts of different lengths"),
        Case("llama3_8b_chunked_prefill", _maker((256, 1, 1, 128), (1280, 700, 33, 128), 32, 8, 128),
             quick, "Llama-3-8B chunked prefill mixed with decodes: a 256-query chunk starting at "
             "position 1024 of a cached prompt, two decodes, a fresh prompt"),
        Case("gpt_oss_120b_tp8_window_sinks_decode",
             _maker((1,) * 8, (4096, 100, 129, 128, 127, 1, 2000, 3000), 8, 1, 64,
                    sliding_window=128, with_sinks=True), quick,
             "gpt-oss-120b at TP8 (64/8 heads of 64 -> 8/1): its sliding-window layers (W 128) with "
             "attention sinks; contexts around the window size"),
        Case("gpt_oss_120b_tp8_sinks_prefill", _maker((300, 64), (300, 1000), 8, 1, 64, with_sinks=True),
             quick, "gpt-oss-120b's full-attention layers: sinks with causal prefill and a chunk"),
        Case("gemma2_soft_cap", _maker((1, 40, 1), (300, 40, 77), 16, 8, 256, logits_soft_cap=30.0,
                                       scale=1.0), quick,
             "Gemma-2-9B-like heads (16/8, D 256) with its attention soft cap (50 in the model; 30 "
             "with scale 1.0 so scores of ~N(0, 256) really are capped)"),
        Case("llama3_8b_fp8_decode_b8_ctx4096", _decode(8, 4096, 32, 8, cache_dtype=FP8,
                                                         scales=(0.23, 0.31)), model,
             "Llama-3-8B decode with an fp8 e4m3 KV cache and per-tensor scales" + scaled),
        Case("small_gqa_decode_fp16", _maker((1, 1, 1), (1, 17, 40), 4, 2, 64, dtype=torch.float16), rand,
             "fp16 GQA decode; lengths 1, one past a block, and a partial block"),
        Case("small_mixed_batch", _maker((3, 1, 9, 0, 5), (10, 8, 9, 6, 21), 6, 2, 32, block_size=8), rand,
             "mixed chunked prefill, decode, full prefill, a sequence with no queries this step, "
             "block size 8, Hq / Hkv = 3"),
        Case("small_non_causal", _maker((4, 7), (9, 7), 4, 4, 16, block_size=4, causal=False), rand,
             "causal=False: every query sees all its sequence's positions (MHA, Hq = Hkv)"),
        Case("small_sliding_window", _maker((6, 1, 12), (20, 13, 12), 4, 1, 32, block_size=4,
                                            sliding_window=5), rand,
             "W = 5 across block boundaries: chunked prefill, decode, full prefill (MQA)"),
        Case("small_soft_cap_sinks_window",
             _maker((2, 5), (11, 5), 4, 2, 16, block_size=4, logits_soft_cap=3.0, scale=0.6,
                    with_sinks=True, sliding_window=4), rand,
             "every option at once: soft cap that bites, sinks, window"),
        Case("small_fp8", _maker((3, 1), (19, 6), 4, 2, 32, block_size=8, cache_dtype=FP8,
                                 scales=(0.3, 0.07)), rand,
             "fp8 cache with scales that are not powers of two"),
        Case("small_fp8_no_scale", _maker((1, 2), (5, 9), 2, 1, 16, block_size=4, cache_dtype=FP8,
                                          dtype=torch.float16, scale=0.05), rand,
             "fp8 cache without scales (1.0), fp16 queries; scale 0.05 keeps codes of ~N(0, 16) tame"),
        Case("empty_batch", _maker((), (), 32, 8, 128), edge, "B = 0, T = 0: returns [0, Hq, D]"),
        Case("no_queries", _maker((0, 0), (5, 16), 4, 2, 16, block_size=4), edge,
             "B = 2 but T = 0: nothing to attend"),
        Case("single_token", _maker((1,), (1,), 4, 1, 16), edge,
             "sequence length 1: the first decode/prefill token attends only to itself"),
        Case("partial_blocks", _maker((2, 1, 1), (17, 31, 15), 4, 2, 16, block_size=16), edge,
             "lengths 17, 31 and 15 with block size 16: the last block's tail holds stale random data"),
        Case("table_slack_shared_prefix",
             _maker((1, 4, 1), (40, 36, 48), 4, 2, 16, block_size=8, table_slack=9, spare_blocks=20,
                    shared_prefix_blocks=3), edge,
             "prefix caching: three sequences share their first 3 blocks; block-table rows have 9+ "
             "unused trailing entries pointing at random blocks; non-monotonic ids"),
        Case("block_size_1", _maker((2, 1), (5, 3), 2, 1, 8, block_size=1), edge,
             "block size 1: one position per block"),
        Case("window_edges", _maker((3, 1, 1), (3, 9, 2), 2, 1, 8, block_size=4, sliding_window=1), edge,
             "W = 1: each query sees only itself"),
        Case("window_wider_than_context", _maker((4, 1), (6, 3), 2, 1, 8, block_size=4, sliding_window=1000),
             edge, "W larger than every sequence: the same as no window"),
    )



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn batches: up to 4 sequences of mixed query and context lengths (decode, prefill,
    chunks, empty), GQA groups, head dims 16-128, blocks of 1-16, windows, caps, sinks, fp8 caches."""
    causal = draw(st.booleans())
    lengths = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=4))
    q_lens = tuple(min(q, kv) if causal else (q if kv else 0) for q, kv in lengths)
    kv_lens = tuple(kv for _, kv in lengths)
    num_heads, num_kv_heads = draw(st.sampled_from([(1, 1), (4, 1), (4, 2), (8, 1), (6, 3)]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    window = draw(st.sampled_from([0, 0, 1, 5])) if causal else 0
    cap = draw(st.sampled_from([0.0, 0.0, 30.0]))
    sinks = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    fp8 = draw(st.booleans())
    return drawn(f"q {q_lens} over kv {kv_lens}, {num_heads}/{num_kv_heads} heads, D {head_dim}, block "
                 f"{block_size}, causal {causal}, window {window}, cap {cap}, sinks {sinks}, {str(dtype)[6:]}"
                 f"{', fp8 cache' if fp8 else ''}",
                 _maker(q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                        FP8 if fp8 else None, causal, window, cap, sinks, scales=(0.25, 0.3) if fp8 else None))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=paged_attention,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    check_data=check_data,
    shapes=_shapes,
)
