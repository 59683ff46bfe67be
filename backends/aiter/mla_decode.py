"""The aiter backend's mla_decode on ``aiter.mla.mla_decode_fwd`` (non-persistent asm kernels), over
kernelmux's 576-wide latent cache seen as pages of one token, with the per-token CSR page lists built
from the block table on the device (``metadata``, timed apart by the bench)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import mla_decode as spec

__all__ = ["TokenLists", "metadata", "mla_decode", "supports", "token_lists"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/mla.py mla_decode_fwd, csrc/py_itfs_cu/asm_mla.cu
# mla_decode_stage1_asm_fwd and hsa/gfx942|gfx950/mla/mla_asm.csv.
RANK, ROPE = 512, 64  # the asm kernels' c_kv and k_pe widths
# The (heads, query length) pairs a non-persistent bf16 x bf16 call finds a kernel for: asm_mla.cu maps
# (gqa_ratio = heads, max_seqlen_q) to a csv row (qType bf16, kvType bf16, ps 0) and fails without one.
# 16 heads: 1 -> qSeqLen 1, 2..4 -> 4, 5..8 -> 8; 32 and 128 heads: qSeqLen 0 (any; sub_Q tiles of
# 64 and 128 rows), held here to the MTP lengths 1..4; 64 heads: 1 -> qSeqLen 1 (a gfx950 kernel
# only), else 0; 8 heads: qSeqLen as given (1 on both, 2 on gfx950). 32 heads on gfx950: see BROKEN.
KERNELS: dict[str, dict[int, frozenset[int]]] = {
    "gfx942": {16: frozenset(range(1, 9)), 32: frozenset(range(1, 5)), 64: frozenset(range(2, 5)),
               128: frozenset(range(1, 5)), 8: frozenset({1})},
    "gfx950": {16: frozenset(range(1, 9)), 32: frozenset(range(1, 5)), 64: frozenset(range(1, 5)),
               128: frozenset(range(1, 5)), 8: frozenset({1, 2})},
}
# vLLM's _aiter_ops.py (_rocm_aiter_mla_decode_fwd_lse_impl) forces one KV split there: "The gfx950 H32
# BF16 kernel mishandles ragged tails with split KV"; aiter picks the split count itself.
BROKEN = {("gfx950", 32): "the gfx950 32-head bf16 kernel mishandles ragged tails with split KV (vLLM's _aiter_ops.py)"}


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when mla_decode_fwd computes calls with this dispatch key as the spec defines, else why not."""
    if key.width != RANK + ROPE or key.kv_lora_rank != RANK:
        return (f"rows of {RANK + ROPE} with kv_lora_rank {RANK} only (DeepSeek MLA), got {key.width} and "
                f"{key.kv_lora_rank}")
    if key.q_dtype != torch.bfloat16 or key.cache_dtype != torch.bfloat16:
        # asm_mla.cu accepts bf16 or fp8 q; the bf16 x fp8 kernels (a16w8) are persistent-mode only.
        return (f"bf16 q and cache only (the non-persistent asm kernels are bf16 x bf16 or fp8 x fp8), got "
                f"{key.q_dtype} x {key.cache_dtype}")
    if key.return_lse:
        # The one-split paths return the kernel's own lse buffer, which kernels without an lse variant
        # leave unwritten (vLLM's _rocm_aiter_mla_decode_fwd_lse_impl works around it per arch).
        return "no lse: whether the non-persistent kernel writes it depends on the split count aiter picks per call"
    if key.max_query_len == 0:
        return None  # nothing reaches the vendor
    if not key.uniform_queries:
        # stride_Q = q.stride(0) * max_seqlen_q (asm_mla.cu): sequence b's queries are read at b * that.
        return ("every sequence with max_query_len queries only (the asm kernel addresses sequence b's queries "
                "at b * max_seqlen_q rows)")
    broken = BROKEN.get((platform.arch, key.num_heads))
    if broken is not None:
        return f"{key.num_heads} heads on {platform.arch}: {broken}"
    lengths = KERNELS.get(platform.arch, {}).get(key.num_heads)
    if lengths is None:
        return (f"{key.num_heads} heads: no non-persistent bf16 kernel on {platform.arch} (heads "
                f"{sorted(KERNELS.get(platform.arch, {}))})")
    if key.max_query_len not in lengths:
        return (f"{key.max_query_len} queries per sequence with {key.num_heads} heads: no non-persistent bf16 "
                f"kernel on {platform.arch} (query lengths {sorted(lengths)})")
    if not key.kv_cache_layout.dense_rows:
        return f"kv_cache needs unit-stride, 16-byte aligned rows, got {key.kv_cache_layout}"
    return None


class TokenLists(NamedTuple):
    """The cache as mla_decode_fwd reads it with page size 1: sequence ``b``'s positions are the rows
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ``kv_buffer [rows, 1, 1, 576]``."""

    kv_buffer: torch.Tensor
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [B * max_seq_len] int32: the first kv_indptr[B] are used, the rest is slack
    kv_last_page_lens: torch.Tensor  # [B] int32, all 1


def token_lists(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                max_seq_len: int) -> TokenLists:
    """Metadata conversion, device ops only (no sync): the block table expanded to one index per
    position, position ``j`` of sequence ``b`` at row ``block_table[b, j // bs] * rows_per_block +
    j % bs`` of the cache viewed as token rows (``rows_per_block = stride(0) / stride(1)``, the block
    size for a dense cache), packed one sequence after another."""
    num_blocks, block_size, width = kv_cache.shape
    row, block = kv_cache.stride(1), kv_cache.stride(0)
    if block % row:
        raise ValueError(f"mla_decode (aiter): kv_cache's block stride {block} is not a multiple of its row stride "
                         f"{row}, so its rows are not one strided array (page size 1 needs that)")
    rows_per_block = block // row
    rows = (num_blocks - 1) * rows_per_block + block_size if num_blocks else 0
    kv_buffer = kv_cache.as_strided((rows, 1, 1, width), (row, width, width, 1))
    num_seqs = seq_lens.shape[0]
    device = block_table.device
    lengths = seq_lens.to(torch.int64)
    indptr = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, dim=0, out=indptr[1:])
    position = torch.arange(max_seq_len, device=device)
    used = position[None, :] < lengths[:, None]  # [B, max_seq_len]
    blocks = min(-(-max_seq_len // block_size), block_table.shape[1])
    column = (position // block_size).clamp(max=max(blocks - 1, 0))
    slot = block_table[:, :blocks].to(torch.int64).gather(1, column.expand(num_seqs, -1)) * rows_per_block
    slot = slot + position % block_size
    # Used positions go to their packed place; the rest to one slack slot past every packed place.
    target = torch.where(used, indptr[:-1, None] + position[None, :], num_seqs * max_seq_len)
    indices = torch.zeros(num_seqs * max_seq_len + 1, dtype=torch.int32, device=device)
    indices.scatter_(0, target.flatten(), slot.to(torch.int32).flatten())
    last = torch.ones(num_seqs, dtype=torch.int32, device=device)
    return TokenLists(kv_buffer, indptr.to(torch.int32), indices[:-1], last)


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel, for the bench to time apart: the per-token page lists."""
    if kwargs["q"].shape[0] == 0:
        return None
    return token_lists(kwargs["kv_cache"], kwargs["block_table"], kwargs["seq_lens"], kwargs["max_seq_len"])


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
    """The spec's mla_decode on mla_decode_fwd; arguments are validated by the caller and accepted by
    ``supports`` (bf16, uniform query counts, no lse)."""
    from aiter.mla import mla_decode_fwd

    num_tokens, num_heads = q.shape[0], q.shape[1]
    out = torch.empty((num_tokens, num_heads, RANK), dtype=q.dtype, device=q.device)
    lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    lists = token_lists(kv_cache, block_table, seq_lens, max_seq_len)
    query = q if q.is_contiguous() else q.contiguous()  # AITER_CHECK(Q->is_contiguous())

    def call():
        mla_decode_fwd(
            q=query, kv_buffer=lists.kv_buffer, o=out, qo_indptr=cu_seqlens_q.to(torch.int32).contiguous(),
            kv_indptr=lists.kv_indptr, kv_indices=lists.kv_indices, kv_last_page_lens=lists.kv_last_page_lens,
            max_seqlen_q=max_query_len, page_size=1, nhead_kv=1, sm_scale=float(scale), logit_cap=0.0,
            return_lse=False, causal=True,
        )

    # The asm kernels are code objects (hsa/<arch>/mla); the Triton stage-2 merge compiles per shape.
    first_calls.run(AITER, spec.NAME, (num_heads, max_query_len), WHERE + ", and Triton's cache", call)
    return out, lse
