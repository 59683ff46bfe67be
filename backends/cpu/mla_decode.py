"""The cpu backend's mla_decode: the chunked gather-then-flash routine of _paged_gather.py over the
latent cache, every head a row of one problem."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._paged_gather import paged_attend

__all__ = ["mla_decode"]


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int = 512,
    kv_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's mla_decode on CPU tensors; arguments are validated by the caller."""
    # Values are the keys' first kv_lora_rank dims: attend with V = K (one gather, the kernel
    # wants equal widths) and keep the first kv_lora_rank output dims.
    out, lse = paged_attend(
        q, kv_cache, None, cu_seqlens_q, block_table, seq_lens, scale=scale,
        k_scale=kv_scale, v_scale=kv_scale, value_width=kv_lora_rank, want_lse=return_lse,
    )
    return out, lse if lse is not None else torch.zeros((0,), dtype=torch.float32)
