"""The flashinfer backend's paged_attention: decode batches of 16-bit caches on xqa through
``trtllm_batch_decode_with_kv_cache`` (it reads kernelmux's block table directly, so it needs no
plan and can be captured in a CUDA graph), prefill and mixed batches on
``BatchPrefillWithPagedKVCacheWrapper`` (fa3 on sm_90, fa2 elsewhere), planned at every call."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.backends.flashinfer._paged import HOST_PLAN, page_lists, refuse_capture, workspace, wrapper
from kernelmux.platforms import Platform
from kernelmux.specs import paged_attention as spec

__all__ = ["decode_reason", "metadata", "paged_attention", "prefill_reason", "supports"]

# xqa runs on these majors (xqa.py); it is asked for by name, since "auto" means trtllm-gen on sm_100.
XQA_MAJORS = frozenset({9, 10, 12})
XQA_PAGE_SIZES = frozenset({16, 32, 64, 128})  # jit/xqa.py: TOKENS_PER_PAGE
XQA_MAX_GROUP = 32  # mha.cu: static_assert(nbValidRows <= 32), one row per query head of a group
PREFILL_HEAD_DIMS = frozenset({64, 128, 256})  # the head dims FlashInfer's prefill modules instantiate
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"


def decode_reason(key: spec.Key, platform: Platform) -> Optional[str]:
    """Why xqa cannot take a decode batch with this key (None when it can)."""
    if platform.capability[0] not in XQA_MAJORS:
        return f"xqa runs on sm_90, sm_100, sm_120, not {platform.arch}"
    if not key.uniform_queries:
        return "one query per sequence only (xqa reads B * 1 query rows); this batch has sequences with none"
    if key.cache_dtype != key.query_dtype:
        # mha_sm90.cu rounds Q and the probabilities to e4m3 for an fp8 cache: outside the spec's
        # tolerance (specs/_tolerance.py ATTENTION_OUTPUT) at short contexts and for fp16 queries.
        return f"a cache of the query's dtype only (xqa's fp8 path computes in e4m3), got {key.cache_dtype}"
    if key.block_size not in XQA_PAGE_SIZES:
        return f"block sizes {sorted(XQA_PAGE_SIZES)} only (xqa's page sizes), got {key.block_size}"
    if key.head_dim % 16 or not 16 <= key.head_dim <= 256:
        return f"head dims that are multiples of 16 in [16, 256] only (xqa), got {key.head_dim}"
    group = key.num_heads // key.num_kv_heads
    if group > XQA_MAX_GROUP:
        return f"up to {XQA_MAX_GROUP} query heads per kv head (xqa), got {group}"
    if key.logits_soft_cap:
        return "no logits soft cap (xqa has none)"
    return None


def prefill_reason(key: spec.Key, platform: Platform) -> Optional[str]:
    """Why the prefill wrapper cannot take a batch with this key (None when it can)."""
    if platform.capability < (8, 0):
        return f"BatchPrefillWithPagedKVCacheWrapper needs sm_80 or newer, not {platform.arch}"
    if key.cache_dtype != key.query_dtype:
        # Its run() takes the fp8 scales as host floats; unconfirmed against the reference here.
        return f"a cache of the query's dtype only for prefill batches, got {key.cache_dtype}"
    if key.head_dim not in PREFILL_HEAD_DIMS:
        return f"head dims {sorted(PREFILL_HEAD_DIMS)} only for prefill batches, got {key.head_dim}"
    if key.sinks_layout is not None:
        return "no sinks in prefill batches (not wired: the wrapper's run takes them, unconfirmed here)"
    return None


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when FlashInfer computes calls with this dispatch key as the spec defines them."""
    if key.query_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 queries only, got {key.query_dtype}"
    for name in ("query", "k_cache", "v_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} needs a unit stride along the head dim (FlashInfer's loads), got {getattr(key, name + '_layout')}"
    if key.max_query_len_class == 0:
        return None  # no queries: nothing reaches FlashInfer
    if not key.same_kv_strides:
        # xqa (xqa_wrapper.cu) and the fa2 prefill address V with K's strides.
        return "k_cache and v_cache with the same strides only (xqa and fa2 address both with K's)"
    return decode_reason(key, platform) if key.decode else prefill_reason(key, platform)


def capture_check(key: spec.Key, platform: Platform) -> Optional[str]:
    """Decode batches (xqa on the block table, no plan) can be captured in a CUDA graph; prefill
    batches plan the wrapper on the host at every call."""
    return None if key.decode or key.max_query_len_class == 0 else f"prefill: {HOST_PLAN}"


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: for a prefill batch
    the block table's conversion to page lists and the wrapper's plan (a host sync); a decode
    batch needs neither (xqa reads the block table)."""
    if kwargs["max_query_len"] <= 1 or kwargs["query"].shape[0] == 0:
        return None
    return _plan(kwargs["query"], kwargs["k_cache"], kwargs["cu_seqlens_q"], kwargs["block_table"],
                 kwargs["seq_lens"], kwargs["scale"], kwargs["causal"], kwargs["sliding_window"],
                 kwargs["logits_soft_cap"])


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
    """The spec's paged_attention on FlashInfer; arguments are validated by the caller and accepted
    by ``supports``."""
    if max_query_len == 0 or query.shape[0] == 0:
        return torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if max_query_len == 1:
        return _decode(query, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale, sliding_window, sinks)
    return _prefill(query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, scale, causal, sliding_window,
                    logits_soft_cap)


def _decode(query, k_cache, v_cache, block_table, seq_lens, max_seq_len, scale, sliding_window, sinks) -> torch.Tensor:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    # 16-bit caches only (supports): no k_scale or v_scale; xqa's logits are bmm1_scale * q.k.
    query = query.contiguous()
    out = torch.empty_like(query)
    variant = ("decode", query.dtype, k_cache.shape[1], query.shape[2],
               query.shape[1] // k_cache.shape[2], sliding_window > 0)

    def call():
        trtllm_batch_decode_with_kv_cache(
            query=query, kv_cache=(k_cache, v_cache), workspace_buffer=workspace(query.device, "decode"),
            block_tables=block_table.contiguous(), seq_lens=seq_lens.contiguous().view(torch.uint32),
            max_seq_len=max_seq_len, bmm1_scale=scale, bmm2_scale=1.0,
            window_left=sliding_window - 1 if sliding_window > 0 else -1, out=out,
            sinks=sinks.float().contiguous() if sinks is not None else None, kv_layout="NHD", backend="xqa",
        )

    first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
    return out


def _plan(query, k_cache, cu_seqlens_q, block_table, seq_lens, scale, causal, sliding_window, logits_soft_cap):
    """The prefill wrapper of this device, planned for this batch."""
    from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper

    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    pages = page_lists(block_table, seq_lens, block_size)
    prefill = wrapper(query.device, "prefill",
                      lambda buffer: BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer=buffer, kv_layout="NHD"))
    prefill.plan(
        qo_indptr=cu_seqlens_q.to(torch.int32), paged_kv_indptr=pages.indptr, paged_kv_indices=pages.indices,
        paged_kv_last_page_len=pages.last_page_len, num_qo_heads=query.shape[1], num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim, page_size=block_size, causal=causal, sm_scale=scale,
        window_left=sliding_window - 1 if sliding_window > 0 else -1,
        logits_soft_cap=logits_soft_cap if logits_soft_cap > 0 else None,
        q_data_type=query.dtype, kv_data_type=k_cache.dtype,
    )
    return prefill


def _prefill(query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, scale, causal, sliding_window,
             logits_soft_cap) -> torch.Tensor:
    refuse_capture("flashinfer's paged prefill")
    variant = ("prefill", query.dtype, query.shape[2], sliding_window > 0, logits_soft_cap > 0)

    def call():
        prefill = _plan(query, k_cache, cu_seqlens_q, block_table, seq_lens, scale, causal, sliding_window,
                        logits_soft_cap)
        return prefill.run(query.contiguous(), (k_cache, v_cache))

    return first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
