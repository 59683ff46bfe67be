"""The flashinfer backend's mla_decode: ``BatchMLAPagedAttentionWrapper`` (fa3 on sm_90, fa2
elsewhere) over kernelmux's 576-wide latent cache, read as its c_kv and k_pe column views; the
wrapper plans on the host at every call. The sm_100/sm_120 trtllm-gen and xqa MLA entry points
are not wired: they need the packed 0.7 API."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.backends.flashinfer._paged import page_lists, refuse_capture, wrapper
from kernelmux.platforms import Platform
from kernelmux.specs import mla_decode as spec

__all__ = ["metadata", "mla_decode", "supports"]

RANK, ROPE = 512, 64  # DeepSeek's c_kv and k_pe widths: the heads the fa2/fa3 MLA modules are built for
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when FlashInfer's MLA wrapper computes calls with this dispatch key as the spec defines."""
    if platform.capability < (8, 0):
        return f"BatchMLAPagedAttentionWrapper needs sm_80 or newer, not {platform.arch}"
    if key.width != RANK + ROPE or key.kv_lora_rank != RANK:
        return f"rows of {RANK + ROPE} with kv_lora_rank {RANK} only (DeepSeek MLA), got {key.width} and {key.kv_lora_rank}"
    if key.q_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 q only, got {key.q_dtype}"
    if key.cache_dtype != key.q_dtype:
        # Its fp8 path (fa3, sm_90, bf16 q) ran on the H100 with every lse 2.5e-3 relative off (0.035
        # absolute, DeepSeek-V3 16 and 128 heads, B 8-128 x 4096); the spec allows 1e-5.
        return f"a cache of q's dtype ({key.q_dtype}) only; fp8 caches disagree with the reference, got {key.cache_dtype}"
    for name in ("q", "kv_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} needs a unit stride along its last dim, got {getattr(key, name + '_layout')}"
    return None


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: the block table's
    conversion to page lists and the wrapper's plan (a host sync)."""
    q = kwargs["q"]
    if q.shape[0] == 0:
        return None
    return _plan(q, kwargs["kv_cache"], kwargs["cu_seqlens_q"], kwargs["block_table"], kwargs["seq_lens"],
                 kwargs["scale"])


def _plan(q, kv_cache, cu_seqlens_q, block_table, seq_lens, scale):
    """The MLA wrapper of this device, planned for this batch."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    block_size = kv_cache.shape[1]
    pages = page_lists(block_table, seq_lens, block_size)
    mla = wrapper(q.device, "mla", lambda buffer: BatchMLAPagedAttentionWrapper(float_workspace_buffer=buffer))
    mla.plan(
        qo_indptr=cu_seqlens_q.to(torch.int32), kv_indptr=pages.indptr, kv_indices=pages.indices,
        kv_len_arr=seq_lens.to(torch.int32), num_heads=q.shape[1], head_dim_ckv=RANK, head_dim_kpe=ROPE,
        page_size=block_size, causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
    )
    return mla


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
    """The spec's mla_decode on FlashInfer's MLA wrapper; arguments are validated by the caller and
    accepted by ``supports``."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    device = q.device
    if num_tokens == 0:
        return (torch.empty((0, num_heads, RANK), dtype=q.dtype, device=device),
                torch.empty((0, num_heads) if return_lse else (0,), dtype=torch.float32, device=device))
    refuse_capture("flashinfer's MLA wrapper")
    variant = (q.dtype, kv_cache.dtype, num_heads)

    def call():
        mla = _plan(q, kv_cache, cu_seqlens_q, block_table, seq_lens, scale)
        return mla.run(q_nope=q[..., :RANK], q_pe=q[..., RANK:], ckv_cache=kv_cache[..., :RANK],
                       kpe_cache=kv_cache[..., RANK:], return_lse=return_lse, return_lse_base_on_e=True)

    result = first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
    if return_lse:
        return result
    return result, torch.empty((0,), dtype=torch.float32, device=device)
