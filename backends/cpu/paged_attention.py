"""The cpu backend's paged_attention: the chunked gather-then-flash routine of _paged_gather.py,
with the GQA heads of each KV head packed as rows of one problem."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._paged_gather import paged_attend

__all__ = ["paged_attention"]


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
    """The spec's paged_attention on CPU tensors; arguments are validated by the caller."""
    out, _ = paged_attend(
        query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, scale=scale, causal=causal,
        window=sliding_window, soft_cap=logits_soft_cap, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale,
    )
    return out
