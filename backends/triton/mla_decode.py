"""The triton backend's mla_decode: the paged-attention kernel with one latent KV head, values taken
from the key tile (plans and launch: _attention.py; kernel: _attention_kernel.py)."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.triton._attention import kind_for, launch, launch_limit, plan_for
from kernelmux.platforms import Platform
from kernelmux.specs import mla_decode as spec

__all__ = ["MAX_MLA_WIDTH", "mla_decode", "supports"]

# Register tiles: a [BLOCK_M, next_pow2(kv_lora_rank)] fp32 accumulator, the query tile and the
# KV tile. Past this row width they spill; DeepSeek's 512 + 64 is well inside.
MAX_MLA_WIDTH = 1024


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key on ``platform``, else why not."""
    if key.width > MAX_MLA_WIDTH:
        return f"row width {key.width} > {MAX_MLA_WIDTH}: the register tiles would spill"
    for name in ("q", "kv_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} has a non-unit stride along the row"
    kind = kind_for(key.max_query_len, key.cache_dtype, mla=True)
    return launch_limit(kind, platform, key.cache_dtype, key.num_heads, key.num_seqs_class,
                        key.num_tokens_class, key.uniform_queries and key.max_query_len <= 1)


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
    """The spec's mla_decode: one tiled launch over the latent cache (plus a merge when the KV
    range is split); arguments are validated by the caller."""
    num_tokens, num_heads, width = q.shape
    device = q.device
    out = torch.empty((num_tokens, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.empty((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    if num_tokens == 0 or max_query_len == 0:
        return out.zero_(), lse.zero_()
    kind = kind_for(max_query_len, kv_cache.dtype, mla=True)
    plan = plan_for(kind, device, seq_lens.shape[0], num_tokens, num_heads, 1, max_query_len, max_seq_len,
                    head_dim=width)
    launch(
        q=q, k=kv_cache, v=kv_cache, out=out, lse=lse if return_lse else None, cu_seqlens_q=cu_seqlens_q,
        block_table=block_table, seq_lens=seq_lens, sinks=None, k_scale=kv_scale, v_scale=kv_scale,
        max_query_len=max_query_len, scale=scale, causal=True, window=0, soft_cap=0.0, group=num_heads,
        d_main=kv_lora_rank, d_rope=width - kv_lora_rank, v_from_k=True, plan=plan,
    )
    return out, lse
