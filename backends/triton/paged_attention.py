"""The triton backend's paged_attention: which calls the tiled kernel takes, and the call itself
(plans and launch: _attention.py; kernel: _attention_kernel.py)."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.triton._attention import kind_for, launch, launch_limit, plan_for
from kernelmux.platforms import Platform
from kernelmux.specs import paged_attention as spec

__all__ = ["MAX_HEAD_DIM", "paged_attention", "supports"]

# Register tiles: a [BLOCK_M, next_pow2(D)] fp32 accumulator, the query tile and two KV tiles.
# Past this width they spill; no model in the spec's cases comes near.
MAX_HEAD_DIM = 256


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key on ``platform``, else why not.
    The kernel reads any strides of the index tensors and sinks; rows must be contiguous."""
    if key.head_dim > MAX_HEAD_DIM:
        return f"head dim {key.head_dim} > {MAX_HEAD_DIM}: the register tiles would spill"
    for name in ("query", "k_cache", "v_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} has a non-unit stride along the head dim"
    group = key.num_heads // key.num_kv_heads
    kind = kind_for(key.max_query_len_class, key.cache_dtype, mla=False)
    return launch_limit(kind, platform, key.cache_dtype, group, key.num_seqs_class, key.num_tokens_class,
                        key.uniform_queries and key.decode)


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
    """The spec's paged_attention: one tiled launch (plus a merge when the KV range is split);
    arguments are validated by the caller."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0 or max_query_len == 0:
        return out.zero_()
    group = num_q_heads // k_cache.shape[2]
    kind = kind_for(max_query_len, k_cache.dtype, mla=False)
    plan = plan_for(kind, query.device, seq_lens.shape[0], num_tokens, group, k_cache.shape[2],
                    max_query_len, max_seq_len, head_dim=head_dim)
    launch(
        q=query, k=k_cache, v=v_cache, out=out, lse=None, cu_seqlens_q=cu_seqlens_q,
        block_table=block_table, seq_lens=seq_lens, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        max_query_len=max_query_len, scale=scale, causal=causal, window=sliding_window,
        soft_cap=logits_soft_cap, group=group, d_main=head_dim, d_rope=0, v_from_k=False, plan=plan,
    )
    return out
