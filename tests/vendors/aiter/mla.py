"""Fake aiter.mla: mla_decode_fwd (plain Python) with the shipped signature, the non-persistent asm
path's checks (aiter/mla.py, csrc/py_itfs_cu/asm_mla.cu) and kernel table (hsa/<gfx>/mla/mla_asm.csv,
bf16 x bf16, ps 0), and the attention computed here in fp64 over the pages the CSR lists name."""
import torch

from .jit.utils.chip_info import get_gfx

CALLS = []
# (gqa, qSeqLen) of the non-persistent bf16 x bf16 decode rows of mla_asm.csv; qSeqLen 0 = any.
ROWS = {
    "gfx942": {(128, 0), (16, 1), (16, 4), (16, 8), (32, 0), (64, 0), (8, 1)},
    "gfx950": {(128, 0), (16, 1), (16, 4), (16, 8), (32, 0), (64, 0), (64, 1), (8, 1), (8, 2)},
}


def _row(gqa, max_seqlen_q):
    """The csv key asm_mla.cu looks up for a non-persistent bf16 call (its config_max_seqlen_q)."""
    if gqa == 128 or gqa == 32:
        return gqa, 0
    if gqa == 16:
        return gqa, 1 if max_seqlen_q == 1 else 4 if max_seqlen_q <= 4 else 8
    if gqa == 64:
        return gqa, 1 if max_seqlen_q == 1 else 0
    return gqa, max_seqlen_q


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,  # 1.0 / (qk_head_dim**0.5)
    logit_cap=0.0,
    num_kv_splits=None,  # for experts only!!!
    num_kv_splits_indptr=None,  # for experts only!!!
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode=False,
    return_logits=False,
    return_lse=False,
    g_kv_indptr=None,
    cp_world_size=1,
    cp_rank=0,
    causal=True,
):
    CALLS.append(dict(heads=q.shape[1], max_seqlen_q=max_seqlen_q, page_size=page_size, causal=causal))
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    if work_meta_data is not None or num_kv_splits is not None or return_lse or return_logits or cp_world_size != 1:
        raise NotImplementedError("fake: the non-persistent path without lse only")
    if q.dtype != torch.bfloat16 or kv_buffer.dtype != torch.bfloat16 or o.dtype != torch.bfloat16:
        raise NotImplementedError(f"fake: bf16 x bf16 modelled, got {q.dtype} x {kv_buffer.dtype} -> {o.dtype}")
    if not q.is_contiguous():
        raise RuntimeError("mla_decode_stage1_asm_fwd:only support Q.is_contiguous() for now")
    if page_size != 1:
        raise NotImplementedError("fake: one-token pages (vLLM's kv_buffer.view(-1, 1, 1, 576)) modelled")
    if nhead_kv != 1 or kv_buffer.dim() != 4 or kv_buffer.shape[1] != page_size or kv_buffer.shape[2] != 1:
        raise RuntimeError(f"fake: kv_buffer [pages, page_size, 1, D], got {tuple(kv_buffer.shape)}")
    if kv_buffer.shape[3] != q.shape[2] or kv_buffer.stride(3) != 1:
        raise RuntimeError("mla_decode_stage1_asm_fwd:only support head_size == KV.size(3) for now")
    total, heads, width = q.shape
    if o.shape != (total, heads, 512) or not o.is_contiguous():
        raise ValueError(f"fake: o [T, H, 512] contiguous, got {tuple(o.shape)}")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_last_page_lens", kv_last_page_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise TypeError(f"fake: {name} int32 contiguous")
    gfx = get_gfx()
    if _row(heads, max_seqlen_q) not in ROWS[gfx]:
        raise RuntimeError(f"get_heuristic_kernel_mla: cannot find suitable kernel (gqa {heads}, "
                           f"max_seqlen_q {max_seqlen_q}, {gfx})")
    starts = qo_indptr.tolist()
    batch = len(starts) - 1
    if any(starts[b + 1] - starts[b] != max_seqlen_q for b in range(batch)):
        raise AssertionError("fake: the kernel reads sequence b's queries at b * max_seqlen_q rows (stride_Q)")
    if not bool((kv_last_page_lens == 1).all()):
        raise AssertionError("fake: with one-token pages every last page holds one token")
    scale = width ** -0.5 if sm_scale is None else sm_scale
    bounds = kv_indptr.tolist()
    for b in range(batch):
        rows = kv_indices[bounds[b]:bounds[b + 1]].long()
        kv = kv_buffer[rows, 0, 0].double()
        length, q_len = kv.shape[0], max_seqlen_q
        queries = q[starts[b]:starts[b + 1]].double()  # [q_len, H, D]
        logits = torch.einsum("ihd,jd->hij", queries, kv) * scale
        if causal:
            visible = torch.arange(length)[None, :] <= torch.arange(q_len)[:, None] + length - q_len
            logits = logits.masked_fill(~visible, -torch.inf)
        o[starts[b]:starts[b + 1]] = torch.einsum("hij,jr->ihr", logits.softmax(-1), kv[:, :512]).to(o.dtype)
    return o.view(total, 1, heads, 512), None
