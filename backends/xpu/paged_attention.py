"""The xpu backend's paged_attention: vllm-xpu-kernels' flash_attn_varlen_func on kernelmux's block table
(NHD caches, the same layout), which runs the split-K paged-decode kernel for decode batches and the
chunk-prefill kernel otherwise (csrc/flash_attn/flash_api.cpp mha_varlen_fwd)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import paged_attention as spec

__all__ = ["HEAD_DIMS", "Descales", "descales", "metadata", "paged_attention", "supports"]

# The head sizes the attention kernels are templated for (chunk_prefill_configure.cmake headsize_list;
# the decode policies take the same); a build compiles a subset of them, see supports.
HEAD_DIMS = frozenset({64, 96, 128, 192, 256, 512})
# Pages: any positive multiple of 16 (paged_decode_utils.hpp dispatch_by_page_size, mirrored in
# flash_attn_interface.py _kv_tile_from_block_size).
BLOCK_MULTIPLE = 16


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when flash_attn_varlen_func computes calls with this key as the spec defines them.

    Not decidable here: which (head size, page size, mask) kernels the installed wheel compiled. For
    another one the vendor's wrapper falls back to its PyTorch reference (flash_attn_interface.py,
    "not compiled"), which it logs once; kernelmux sees it only in that log."""
    if key.max_query_len_class == 0:
        return None  # no queries: nothing reaches the vendor
    if key.head_dim not in HEAD_DIMS:
        return f"head dims {sorted(HEAD_DIMS)} only (the kernels' templates), got {key.head_dim}"
    if key.block_size % BLOCK_MULTIPLE:
        return f"block sizes that are multiples of {BLOCK_MULTIPLE} only (the kernels' KV tiles), got {key.block_size}"
    if key.logits_soft_cap:
        # mha_varlen_fwd takes softcap but hands it to neither kernel (flash_api.cpp at 4543b58).
        return "no logits soft cap: the vendor's varlen_fwd accepts softcap and applies it nowhere"
    if key.sinks_layout is not None and key.query_dtype != torch.bfloat16:
        # The kernels read the sinks as the query dtype (chunk_prefill.hpp: reinterpret_cast<ElementQ*>);
        # rounded to fp16 a sink of |s| ~ 6 moves the output by ~3e-3 relative, over fp16's 2e-3.
        return ("sinks with bf16 queries only (the kernels read sinks in the query dtype; fp16 rounding "
                "exceeds its tolerance)")
    for name in ("k_cache", "v_cache"):
        cache_layout = getattr(key, f"{name}_layout")
        if not cache_layout.unit_stride:
            # The wrapper would copy the whole cache (maybe_contiguous) at every call.
            return (f"{name} needs a unit stride along the head dim (else the wrapper copies the cache), "
                    f"got {cache_layout}")
    if not key.same_kv_strides:
        # check_paged_kv_cache_strides wants one page stride in sequence units for both; same strides
        # guarantee it.
        return "k_cache and v_cache with the same strides only (the kernels address both pages alike)"
    return None


class Descales(NamedTuple):
    """The fp8 dequantization scales in the form the wrapper takes: per-tensor values expanded to
    ``[B, Hkv]`` views of one fp32 element each (``_normalize_descale_tensor`` requires a view of a
    one-element storage); None for 16-bit caches."""

    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]


def descales(k_cache: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
             num_seqs: int) -> Descales:
    """Metadata conversion: the spec's optional per-tensor scales as the kernels read them. An fp8
    cache always gets both (the kernels dereference them; FA2 takes both or neither), 1.0 for None."""
    if k_cache.dtype != spec.FP8:
        return Descales(None, None)

    def one(scale: Optional[torch.Tensor]) -> torch.Tensor:
        value = (torch.ones((), dtype=torch.float32, device=k_cache.device) if scale is None
                 else scale.reshape(()).clone())  # a fresh one-element storage, device-side
        return value.expand(num_seqs, k_cache.shape[2])

    return Descales(one(k_scale), one(v_scale))


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: the fp8 descales."""
    if kwargs["query"].shape[0] == 0:
        return None
    return descales(kwargs["k_cache"], kwargs["k_scale"], kwargs["v_scale"], kwargs["seq_lens"].shape[0])


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
    accepted by ``supports``."""
    if max_query_len == 0 or query.shape[0] == 0:
        return torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    from vllm_xpu_kernels import flash_attn_varlen_func

    num_seqs = seq_lens.shape[0]
    scales = descales(k_cache, k_scale, v_scale, num_seqs)
    if max_query_len == 1 and query.shape[0] == num_seqs:
        # Every sequence has its one query: the paged-decode kernel.
        max_seqlen_q, mixed = 1, True
    else:
        # The decode kernel takes one query row per sequence whatever cu_seqlens_q says (it sets
        # seq_len_qo = 1 and writes row cu_seqlens_q[b], paged_decode_kernel.hpp), so a sequence with
        # no query this step would overwrite its neighbour's output. Without is_mix_batch every
        # sequence goes to the chunk-prefill kernel, which skips empty ones; a decode batch with such a
        # sequence gets there with max_seqlen_q 2 (an upper bound, as the spec allows).
        max_seqlen_q, mixed = max(max_query_len, 2), False
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return flash_attn_varlen_func(
        q=query, k=k_cache, v=v_cache, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q.contiguous(),
        max_seqlen_k=max_seq_len, seqused_k=seq_lens.contiguous(), softmax_scale=scale, causal=causal,
        # The spec's window W is FlashAttention's (W - 1, 0): the last W positions, self included.
        window_size=[sliding_window - 1, 0] if sliding_window > 0 else None,
        block_table=block_table.contiguous(), out=out, k_descale=scales.k, v_descale=scales.v,
        s_aux=sinks.to(query.dtype).contiguous() if sinks is not None else None, is_mix_batch=mixed,
    )
