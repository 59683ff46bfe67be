"""The cuda backend's paged_attention entry: calls with ``max_query_len > 1`` on the Hopper prefill
kernel (_paged_prefill.py), decode on the fp8 decode kernel (_paged_decode.py); ``supports`` says
per dispatch key which one takes it, or why neither does."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cuda import _paged_decode, _paged_prefill
from kernelmux.platforms import Platform
from kernelmux.specs import paged_attention as paged_spec

__all__ = ["layout_reason", "paged_attention", "supports"]


def layout_reason(key: paged_spec.Key) -> Optional[str]:
    """Why the decode or the prefill kernel cannot read the call's tensors (None when both can):
    16-byte vector loads of the query and cache rows, and unit-stride reads of the batch
    description and the sinks."""
    for name in ("query", "k_cache", "v_cache"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along the head dim and 16-byte aligned data and row strides "
                    f"(the kernels' vector loads), got {tensor_layout}")
    for name in ("cu_seqlens_q", "block_table", "seq_lens", "sinks"):
        tensor_layout = getattr(key, f"{name}_layout")
        if tensor_layout is not None and not tensor_layout.unit_stride:
            return f"{name} needs a unit stride along its last dim (the kernels index it densely)"
    return None


def supports(key: paged_spec.Key, platform: Platform) -> Optional[str]:
    """None when one of the backend's kernels handles calls with this dispatch key on
    ``platform``, else why not."""
    if not key.decode:
        reason = _paged_prefill.prefill_supports(key, platform)
    else:
        reason = _paged_decode.shape_reason(key.query_dtype, key.cache_dtype, key.num_heads, key.num_kv_heads,
                                            key.head_dim, key.block_size, key.decode)
        if reason is None and key.num_seqs_class > 65535:
            reason = (f"up to {key.num_seqs_class} sequences (this batch's size class) > 65535, CUDA's limit "
                      "on grid axis 1 (split the batch)")
    return reason if reason is not None else layout_reason(key)


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
    """The spec's paged_attention: prefill batches on the prefill kernel, decode on the fp8
    decode kernel (plus a merge when it splits; causal or not is the same at one query).
    Arguments are validated by the caller and accepted by ``supports``."""
    if max_query_len > 1:
        return _paged_prefill.paged_prefill(query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens,
                                            max_query_len, scale, causal, sliding_window, logits_soft_cap, sinks)
    if max_query_len == 0:
        return torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    return _paged_decode.paged_decode(query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, max_seq_len,
                                      scale, sliding_window, logits_soft_cap, sinks, k_scale, v_scale)
