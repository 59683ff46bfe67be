"""Fake aiter.ops.mha: flash_attn_varlen_func (plain Python) with the shipped signature and, for a
paged call (block_table), the checks of its paged forwards (mha_varlen_fwd_kernels.cu and
asm_mha_varlen_fwd.cu); attention computed here in fp64 with the mask its docstring defines."""
import torch
from torch import Tensor

CALLS = []


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1, 0),  # -1 means infinite context window, 0 means no sink
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_k_padded: Tensor | None = None,
    sink_ptr: Tensor | None = None,
):
    CALLS.append(dict(causal=causal, window_size=window_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    if block_table is None:
        raise NotImplementedError("fake: the paged (block_table) route only")
    if dropout_p or bias is not None or alibi_slopes is not None or return_lse or return_attn_probs:
        raise NotImplementedError("fake: inference without bias, alibi, lse")
    if logits_soft_cap or sink_ptr is not None or (len(window_size) > 2 and window_size[2]):
        raise NotImplementedError("fake: no soft cap, sinks or sink tokens modelled")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise RuntimeError(f"Input tensor must have contiguous last dimension ({name})")
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise RuntimeError("block_table must have dtype torch.int32 with a contiguous last dimension")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is None or t.dtype != torch.int32 or not t.is_contiguous() or t.shape != (block_table.shape[0] + 1,):
            raise RuntimeError(f"{name} must be a contiguous int32 [batch_size + 1]")
    num_blocks, page, heads_k, dim = k.shape
    if page % 128:
        raise RuntimeError("Paged KV cache block size must be divisible by 128")
    if v.shape != k.shape or dim % 8 or dim > 256 or q.shape[1] % heads_k or q.shape[2] != dim:
        raise RuntimeError(f"fake: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.dtype != q.dtype or out.shape != q.shape or out.stride(-1) != 1:
        raise RuntimeError("out: the query's dtype and shape, contiguous last dimension")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size[0], window_size[1]
    if causal:
        right = 0
    group = q.shape[1] // heads_k
    starts, ends = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(block_table.shape[0]):
        q_len, kv_len = starts[b + 1] - starts[b], ends[b + 1] - ends[b]
        if q_len == 0:
            continue
        slots = torch.arange(kv_len)
        pages = block_table[b].long()[slots // page]
        keys = k[pages, slots % page].double().repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        values = v[pages, slots % page].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("ihd,jhd->hij", q[starts[b]:starts[b + 1]].double(), keys) * scale
        i = torch.arange(q_len)[:, None] + kv_len - q_len  # bottom-right aligned
        j = torch.arange(kv_len)[None, :]
        keep = torch.ones(q_len, kv_len, dtype=torch.bool)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        weights = torch.softmax(logits.masked_fill(~keep, -torch.inf), dim=-1).nan_to_num(0.0)
        out[starts[b]:starts[b + 1]] = torch.einsum("hij,jhd->ihd", weights, values).to(out.dtype)
    return out
