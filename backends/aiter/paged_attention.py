"""The aiter backend's paged_attention on ``aiter.flash_attn_varlen_func`` with ``block_table``, aiter's
route over vLLM's NHD cache (CK/asm paged split-KV). ``pa_fwd_asm`` and ``paged_attention_v1`` read the
5-D ROCm layout (``K [blocks, Hkv, D/x, block_size, x]``), which kernelmux's cache is not: unused."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import paged_attention as spec

__all__ = ["metadata", "paged_attention", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/ops/mha.py flash_attn_varlen_func and
# _flash_attn_varlen_forward; csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu and
# csrc/py_itfs_cu/asm_mha_varlen_fwd.cu (both paths check the same).
# "Paged KV cache block size must be divisible by 128" (TORCH_CHECK in both).
BLOCK_MULTIPLE = 128
# "CK only supports head dimension at most 256" and "a head_size that is a multiple of 8"; a head
# dim that is not is padded by FlashAttnVarlenFunc, which the paged cache cannot be.
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 8


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when flash_attn_varlen_func computes calls with this dispatch key as the spec defines."""
    if key.query_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 queries only, got {key.query_dtype}"
    if key.cache_dtype != key.query_dtype:
        # mha_varlen_fwd: "query and key must have the same dtype"; its fp8 path takes fp8 queries.
        return (f"a cache of the query's dtype only (fp8 needs fp8 queries in aiter's paged forward), "
                f"got {key.cache_dtype}")
    if key.block_size % BLOCK_MULTIPLE:
        return (f"block_size a multiple of {BLOCK_MULTIPLE} only (\"Paged KV cache block size must be divisible by "
                f"128\", mha_varlen_fwd), got {key.block_size}")
    if key.head_dim % HEAD_DIM_MULTIPLE or key.head_dim > MAX_HEAD_DIM:
        return f"head dims that are multiples of 8 up to 256 only (CK's fmha), got {key.head_dim}"
    if key.logits_soft_cap:
        # The asm path takes none (can_impl_fmha_v3_fwd) and CK's soft-cap formula is not in aiter's
        # source (composable_kernel is a submodule): unverified against the spec's cap * tanh(s / cap).
        return "no logits soft cap (CK's soft-cap arithmetic is unverified here)"
    if key.sinks_layout is not None:
        # aiter's sink_ptr reaches CK's split-KV kernel as has_sink; its semantics are not in aiter's source.
        return "no sinks (how CK's split-KV kernel applies sink_ptr is unverified here)"
    for name in ("query", "k_cache", "v_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return (f"{name} needs a unit stride along the head dim (\"contiguous last dimension\"), "
                    f"got {getattr(key, name + '_layout')}")
    if not key.block_table_layout.unit_stride:
        return "block_table needs a contiguous last dimension (mha_varlen_fwd's check)"
    return None


def cu_seqlens_k(seq_lens: torch.Tensor) -> torch.Tensor:
    """``[0, L_0, L_0 + L_1, ...]`` int32, on the device: the paged kernels read each sequence's KV
    length from it (seqstart_k)."""
    out = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    out[1:] = torch.cumsum(seq_lens, dim=0, dtype=torch.int32)
    return out


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel, for the bench to time apart: the cumulative KV lengths."""
    return cu_seqlens_k(kwargs["seq_lens"])


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
    """The spec's paged_attention on flash_attn_varlen_func; arguments are validated by the caller and
    accepted by ``supports`` (16-bit caches, block_size % 128, no soft cap, no sinks)."""
    import aiter

    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if max_query_len == 0 or query.shape[0] == 0:
        return out
    # Its mask is bottom-right aligned: query i of a sequence sees keys up to i + L - q_len, and with
    # a window only from i + L - q_len - window_size[0] (its docstring), so the spec's W is (W - 1, 0).
    window = (sliding_window - 1, 0, 0) if sliding_window > 0 else (-1, -1, 0)
    variant = (query.dtype, query.shape[2], k_cache.shape[1], sliding_window > 0)

    def call():
        return aiter.flash_attn_varlen_func(
            q=query, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens_q.to(torch.int32).contiguous(),
            cu_seqlens_k=cu_seqlens_k(seq_lens), max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
            softmax_scale=float(scale), logits_soft_cap=0.0, causal=causal, window_size=window,
            block_table=block_table.to(torch.int32), out=out,
        )

    return first_calls.run(AITER, spec.NAME, variant, WHERE + " (module_mha_varlen_fwd, module_fmha_v3_varlen_fwd)",
                           call)
