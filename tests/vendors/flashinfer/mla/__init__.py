"""Fake flashinfer.mla (0.6.14): BatchMLAPagedAttentionWrapper's __init__/plan/run (fa2/fa3) with the
shipped signatures, checks (planned dtypes, fp8 scales), plan-then-run state and strided c_kv / k_pe
views; trtllm_batch_decode_with_kv_cache_mla's dense trtllm-gen and xqa paths with the shipped
signature, its backend="auto" pick by the device's major and the checks of each path (block sizes,
dtypes, q_len, heads, lse, cum_seq_lens_q, the block table's width); absorbed MLA over the planned page
lists or the block table written here independently, in fp64 (trtllm-gen's lse in base 2, as lse.cuh)."""
import math

import torch

CALLS = []
CAPABILITY = (9, 0)  # the device the fake stands for: "auto" is fa3 on sm_90, fa2 elsewhere; trtllm-gen on
# major 10 and xqa elsewhere for trtllm_batch_decode_with_kv_cache_mla
FP8 = torch.float8_e4m3fn


class BatchMLAPagedAttentionWrapper:
    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        if backend == "cutlass" or use_cuda_graph:
            raise NotImplementedError("the fake models the eager fa2/fa3 wrapper only")
        CALLS.append(dict(entry="BatchMLAPagedAttentionWrapper", backend=backend))
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._backend = ("fa3" if CAPABILITY == (9, 0) else "fa2") if backend == "auto" else backend

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        use_profiler=False,
    ):
        CALLS.append(dict(entry="BatchMLAPagedAttentionWrapper.plan", causal=causal, sm_scale=sm_scale,
                          page_size=page_size, q_data_type=q_data_type, kv_data_type=kv_data_type))
        if kv_data_type not in (torch.float16, torch.bfloat16, FP8):
            raise ValueError(f"MLA kv_data_type {kv_data_type} is not supported.")
        if kv_data_type == FP8:
            if self._backend != "fa3":
                raise ValueError("FP8 kv_data_type for MLA is only supported with the fa3 backend on SM90, "
                                 f"got backend={self._backend!r}.")
            if CAPABILITY[0] != 9:
                raise ValueError(f"FP8 kv_data_type for MLA requires an SM90 (Hopper) device, got {CAPABILITY}.")
            if q_data_type != torch.bfloat16:
                raise ValueError(f"FP8 kv_data_type for MLA currently only supports q_data_type=torch.bfloat16, "
                                 f"got {q_data_type}.")
            if head_dim_ckv != 512 or head_dim_kpe != 64:
                raise ValueError("FP8 kv_data_type for MLA currently only supports head_dim_ckv=512 and "
                                 "head_dim_kpe=64")
        if q_data_type not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q_data_type {q_data_type}: no MLA module for it")
        if (head_dim_ckv, head_dim_kpe) != (512, 64):
            raise ValueError(f"head_dim_ckv {head_dim_ckv}, head_dim_kpe {head_dim_kpe}: no MLA module for them")
        batch = len(qo_indptr) - 1
        for name, tensor, size in (("qo_indptr", qo_indptr, batch + 1), ("kv_indptr", kv_indptr, batch + 1),
                                   ("kv_len_arr", kv_len_arr, batch)):
            if tensor.dtype != torch.int32 or tensor.dim() != 1 or tensor.shape[0] != size:
                raise TypeError(f"{name}: int32 [{size}], got {tensor.dtype} {tuple(tensor.shape)}")
        if kv_indices.dtype != torch.int32 or kv_indices.dim() != 1:
            raise TypeError(f"kv_indices: int32 1-D, got {kv_indices.dtype} {tuple(kv_indices.shape)}")
        qo_host, kv_host, lens = qo_indptr.to("cpu"), kv_indptr.to("cpu"), kv_len_arr.to("cpu")
        if int(kv_host[-1]) > kv_indices.shape[0]:
            raise ValueError(f"kv_indices holds {kv_indices.shape[0]} < kv_indptr[-1] pages")
        if (kv_host.diff() * page_size < lens).any():
            raise ValueError("a request's kv_len needs more pages than kv_indptr gives it")
        self._qo_indptr = qo_host.tolist()
        self._kv_indptr = kv_host.tolist()
        self._kv_lens = lens.tolist()
        self._kv_indices_buf = kv_indices.to(self.device)
        self._num_heads = num_heads
        self._causal = causal
        self._page_size = page_size
        self._sm_scale = sm_scale
        self._q_data_type = q_data_type
        self._kv_data_type = kv_data_type
        self._plan_info = object()

    def run(
        self,
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        out=None,
        lse=None,
        return_lse=False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e=False,
        o_scale=None,
        *,
        ckv_scale=None,
        kpe_scale=None,
    ):
        if o_scale is not None:
            raise ValueError("o_scale is only supported with the cutlass backend for now.")
        # As the shipped one: the planned dtypes are read first, so run() before plan() raises.
        for name, tensor, planned in (("q_nope", q_nope, self._q_data_type), ("q_pe", q_pe, self._q_data_type),
                                      ("ckv_cache", ckv_cache, self._kv_data_type),
                                      ("kpe_cache", kpe_cache, self._kv_data_type)):
            if tensor.dtype != planned:
                raise ValueError(f"{name}.dtype={tensor.dtype} does not match the planned {planned}.")
        if self._kv_data_type == FP8:
            if ckv_scale is None or kpe_scale is None:
                raise ValueError("ckv_scale and kpe_scale are required when kv_data_type is FP8.")
            ckv_scale, kpe_scale = float(ckv_scale), float(kpe_scale)
            for name, value in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale)):
                if not math.isfinite(value) or value <= 0.0:
                    raise ValueError(f"{name} must be a finite positive value, got {value}")
        else:
            if ckv_scale is not None or kpe_scale is not None:
                raise ValueError("ckv_scale / kpe_scale are only valid when kv_data_type is FP8.")
            ckv_scale = kpe_scale = 1.0
        CALLS.append(dict(entry="BatchMLAPagedAttentionWrapper.run", return_lse=return_lse,
                          return_lse_base_on_e=return_lse_base_on_e, ckv_scale=ckv_scale, kpe_scale=kpe_scale,
                          ckv_strides=ckv_cache.stride(), kpe_strides=kpe_cache.stride()))
        tokens, heads, page_size = self._qo_indptr[-1], self._num_heads, self._page_size
        # The kernels take the strides of every dim but the last (batch_mla_run.cu).
        for name, tensor, shape in (("q_nope", q_nope, (tokens, heads, 512)), ("q_pe", q_pe, (tokens, heads, 64)),
                                    ("ckv_cache", ckv_cache, (None, page_size, 512)),
                                    ("kpe_cache", kpe_cache, (None, page_size, 64))):
            if tensor.dim() != 3 or any(want not in (None, got) for want, got in zip(shape, tensor.shape)) \
                    or tensor.stride(-1) != 1:
                raise ValueError(f"{name}: {shape} with a unit last stride, got {tuple(tensor.shape)} "
                                 f"strides {tensor.stride()}")
        if ckv_cache.shape[0] != kpe_cache.shape[0]:
            raise ValueError("ckv_cache and kpe_cache hold different page counts")
        if out is None:
            out = torch.empty_like(q_nope)
        elif out.shape != q_nope.shape or out.dtype != q_nope.dtype:
            raise ValueError(f"out: {tuple(q_nope.shape)} {q_nope.dtype}, got {tuple(out.shape)} {out.dtype}")
        if return_lse and lse is None:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        for b, kv_len in enumerate(self._kv_lens):
            start, end = self._qo_indptr[b], self._qo_indptr[b + 1]
            q_len = end - start
            if q_len == 0:
                continue
            ids = self._kv_indices_buf[self._kv_indptr[b]: self._kv_indptr[b] + -(-kv_len // page_size)].long()
            ckv = ckv_cache[ids].to(torch.float64).reshape(-1, 512)[:kv_len] * ckv_scale
            kpe = kpe_cache[ids].to(torch.float64).reshape(-1, 64)[:kv_len] * kpe_scale
            logits = (torch.einsum("qhd,ld->hql", q_nope[start:end].to(torch.float64), ckv)
                      + torch.einsum("qhd,ld->hql", q_pe[start:end].to(torch.float64), kpe)) * self._sm_scale
            if self._causal:
                row = torch.arange(q_len)[:, None] + (kv_len - q_len)
                logits = logits.masked_fill(torch.arange(kv_len)[None, :] > row, -math.inf)
            lse_e = torch.logsumexp(logits, dim=-1)  # [H, q_len]
            out[start:end] = torch.einsum("hql,ld->qhd", torch.exp(logits - lse_e[..., None]), ckv).to(out.dtype)
            if return_lse:
                lse[start:end] = (lse_e if return_lse_base_on_e else lse_e / math.log(2)).T.float()
        return (out, lse) if return_lse else out


def _absorbed(query, kv_cache, block_tables, seq_lens, q_lens, scale):
    """[tokens, H, 512] fp64 out and [tokens, H] natural-log lse: token t of sequence b (of q_lens[b])
    sits at L_b - q_lens[b] + i and sees positions 0 .. that."""
    page_size = kv_cache.shape[-2]
    outs, lses = [], []
    start = 0
    for b, (kv_len, q_len) in enumerate(zip(seq_lens.tolist(), q_lens)):
        q = query[start: start + q_len].to(torch.float64)
        start += q_len
        ids = block_tables[b, : -(-kv_len // page_size)].long()
        rows = kv_cache.reshape(kv_cache.shape[0], page_size, -1)[ids].to(torch.float64).reshape(-1, 576)[:kv_len]
        logits = torch.einsum("qhd,ld->hql", q, rows) * scale
        row = torch.arange(q_len)[:, None] + (kv_len - q_len)
        logits = logits.masked_fill(torch.arange(kv_len)[None, :] > row, -math.inf)
        lse_e = torch.logsumexp(logits, dim=-1)  # [H, q_len]
        outs.append(torch.einsum("hql,ld->qhd", torch.exp(logits - lse_e[..., None]), rows[:, :512]))
        lses.append(lse_e.T)
    return torch.cat(outs), torch.cat(lses)


def _check_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, page_size, num_seqs):
    if kv_cache.ndim == 3:
        kv_cache = kv_cache.unsqueeze(1)
    elif kv_cache.ndim != 4:
        raise ValueError(f"Expected kv_cache.ndim == 3 or 4, got {kv_cache.ndim}")
    if (kv_lora_rank, qk_rope_head_dim) not in ((512, 64), (256, 64)):
        raise ValueError(f"Unsupported MLA dimensions, got kv_lora_rank={kv_lora_rank} and "
                         f"qk_rope_head_dim={qk_rope_head_dim}")
    if (kv_lora_rank, qk_rope_head_dim) != (512, 64):
        raise NotImplementedError("the fake models DeepSeek's 512 + 64 only")
    expected = kv_lora_rank + qk_rope_head_dim
    if query.shape[-1] != expected or kv_cache.shape[3] != expected:
        raise ValueError(f"Expected head dim {expected} for query and kv_cache, got {query.shape[-1]} and "
                         f"{kv_cache.shape[3]}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables: 2-D with a shared page index, got {block_tables.ndim}-D")
    if num_seqs != block_tables.shape[0]:
        raise ValueError(f"Expected batch size {num_seqs} for query and block_table, got {num_seqs} and "
                         f"{block_tables.shape[0]}")
    if block_tables.shape[-1] % (128 / page_size) != 0:
        raise ValueError(f"Expected block_num % (128 / block_size) == 0, got block_num={block_tables.shape[-1]} "
                         f"and block_size={page_size}")
    # The kernels read these through data_ptr() as int32 / uint32 rows.
    for name, tensor in (("block_tables", block_tables),):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise TypeError(f"{name}: contiguous int32, got {tensor.dtype} strides {tensor.stride()}")
    return kv_cache


def trtllm_batch_decode_with_kv_cache_mla(
    query,
    kv_cache,
    workspace_buffer,
    qk_nope_head_dim,
    kv_lora_rank,
    qk_rope_head_dim,
    block_tables,
    seq_lens,
    max_seq_len,
    sparse_mla_top_k=0,
    out=None,
    bmm1_scale=1.0,
    bmm2_scale=1.0,
    sinks=None,
    skip_softmax_threshold_scale_factor=None,
    enable_pdl=None,
    backend="auto",
    is_var_seq=True,
    uses_shared_paged_kv_idx=True,
    lse=None,
    return_lse=False,
    cute_dsl_impl="auto",
    kv_scale_format="auto",
    cum_seq_lens_q=None,
    max_q_len=None,
):
    for name, value in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
            raise TypeError(f"{name} tensor must have dtype torch.float32")
    if max_q_len is not None and cum_seq_lens_q is None:
        raise ValueError("max_q_len is only supported when cum_seq_lens_q is provided")
    if backend == "auto":
        if CAPABILITY[0] == 12 and sparse_mla_top_k > 0:
            backend = "sparse"
        elif CAPABILITY[0] != 10:
            backend = "xqa"
        else:
            backend = "trtllm-gen"  # the shipped one autotunes between trtllm-gen and cute-dsl here
    CALLS.append(dict(entry="trtllm_batch_decode_with_kv_cache_mla", backend=backend, bmm1_scale=bmm1_scale,
                      bmm2_scale=bmm2_scale, return_lse=return_lse, cum_seq_lens_q=cum_seq_lens_q is not None,
                      max_q_len=max_q_len, query_shape=tuple(query.shape), block_tables_shape=tuple(block_tables.shape),
                      workspace_buffer=workspace_buffer))
    if sparse_mla_top_k > 0 or backend in ("sparse", "cute-dsl"):
        raise NotImplementedError(f"the fake models dense trtllm-gen and xqa only, not {backend}")
    if seq_lens is None:
        raise ValueError("seq_lens is required")
    if seq_lens.dtype != torch.int32 or seq_lens.ndim != 1:
        raise TypeError(f"seq_lens: int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if sinks is not None or skip_softmax_threshold_scale_factor is not None or not uses_shared_paged_kv_idx:
        raise NotImplementedError("the fake models no sinks, no skip-softmax, a shared page index")
    page_size = kv_cache.shape[-2]
    if backend == "xqa":
        if cum_seq_lens_q is not None or max_q_len is not None:
            raise ValueError("XQA MLA does not support cum_seq_lens_q / max_q_len")
        if CAPABILITY[0] != 12:
            raise ValueError("XQA MLA requires SM120a (CUDA >= 12.8) or SM121a (CUDA >= 13.0)")
        if not (query.dtype == kv_cache.dtype == torch.bfloat16 or query.dtype == kv_cache.dtype == FP8):
            raise ValueError(f"XQA MLA on SM120/SM121 supports (fp8, fp8) or (bfloat16, bfloat16) only, got "
                             f"{query.dtype} and {kv_cache.dtype}")
        if query.dtype == FP8:
            raise NotImplementedError("the fake models xqa's bf16 path only (its fp8 one packs P to e4m3)")
        if query.size(1) != 1:
            raise ValueError(f"XQA MLA only supports q_len_per_request == 1, got {query.size(1)}")
        if return_lse or lse is not None:
            raise NotImplementedError("XQA MLA backend does not support return_lse/lse output")
        if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
            raise NotImplementedError("the fake models float scales only")
        if page_size not in (16, 32, 64, 128):
            raise ValueError(f"page_size must be one of [16, 32, 64, 128], got {page_size}")
        if query.shape[2] != 128:
            raise ValueError(f"XQA MLA only supports 128 query heads (head_group_ratio=128), got {query.shape[2]} "
                             "query heads")
        if not query.is_contiguous():
            raise ValueError("xqa: q's TMA descriptor assumes packed rows")
        kv_cache = _check_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, page_size,
                                    query.shape[0])
        result, _ = _absorbed(query.flatten(0, 1), kv_cache, block_tables, seq_lens, [1] * query.shape[0],
                              bmm1_scale * bmm2_scale)  # qkScaleLog2e = q_scale * kv_scale * log2(e)
        result = result.reshape(*query.shape[:-1], 512)
        if out is None:
            out = torch.empty(result.shape, dtype=torch.bfloat16, device=query.device)
        out.copy_(result)
        return out
    if backend != "trtllm-gen":
        raise ValueError(f"Backend {backend} not supported")
    if CAPABILITY[0] != 10:
        raise RuntimeError(f"trtllm-gen MLA kernels are built for SM100/SM103, not {CAPABILITY}")
    if page_size not in (32, 64):
        raise ValueError(f"trtllm-gen requires block_size in (32, 64), got {page_size}")
    if query.dtype != kv_cache.dtype or query.dtype not in (torch.bfloat16, FP8):
        raise NotImplementedError(f"the fake models bf16 q and cache, got {query.dtype} and {kv_cache.dtype}")
    if query.dtype == FP8:
        raise NotImplementedError("the fake models trtllm-gen's bf16 path only")
    if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
        raise NotImplementedError("the fake models float scales only")
    if cum_seq_lens_q is not None:
        if return_lse or lse is not None:
            raise NotImplementedError("trtllm-gen MLA does not support return_lse/lse with cum_seq_lens_q")
        if query.ndim != 3:
            raise ValueError("query must have shape [total_q, num_heads, head_dim_qk] when cum_seq_lens_q is provided")
        if cum_seq_lens_q.dtype != torch.int32 or cum_seq_lens_q.ndim != 1:
            raise TypeError(f"cum_seq_lens_q: int32 1-D, got {cum_seq_lens_q.dtype} {tuple(cum_seq_lens_q.shape)}")
        if cum_seq_lens_q.size(0) < 2:
            raise ValueError("cum_seq_lens_q must contain at least two entries")
        batch_size = cum_seq_lens_q.size(0) - 1
        if batch_size != seq_lens.size(0):
            raise ValueError("Batch size mismatch: cum_seq_lens_q describes "
                             f"{batch_size} sequences, but seq_lens has {seq_lens.size(0)} entries")
        host = cum_seq_lens_q.tolist()
        q_lens = [end - begin for begin, end in zip(host, host[1:])]
        if max_q_len is None:
            if host[0] != 0 or host[-1] != query.size(0) or min(q_lens) < 0:
                raise ValueError("cum_seq_lens_q must start with 0, end at the query length and not decrease")
            max_q_len = max(q_lens)
        elif max_q_len <= 0:
            raise ValueError("max_q_len must be greater than 0")
        elif max_q_len > query.size(0):
            raise ValueError("max_q_len cannot exceed the flattened query length")
        if max(q_lens) > max_q_len:
            raise ValueError("max_q_len below a segment: the kernel's output would be wrong")
        kv_cache = _check_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, page_size,
                                    batch_size)
        result, _ = _absorbed(query, kv_cache, block_tables, seq_lens, q_lens, bmm1_scale)
        if out is None:
            out = torch.empty(result.shape, dtype=torch.bfloat16, device=query.device)
        elif out.shape != result.shape or out.dtype != torch.bfloat16:
            raise ValueError(f"out: {tuple(result.shape)} torch.bfloat16, got {tuple(out.shape)} {out.dtype}")
        out.copy_(result * bmm2_scale)
        return out
    if query.ndim != 4:
        raise ValueError(f"Expected query.ndim == 3 or 4, got {query.ndim}")
    kv_cache = _check_mla_shape(query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, page_size,
                                query.shape[0])
    batch_size, q_len, num_heads = query.shape[:3]
    result, lse_e = _absorbed(query.flatten(0, 1), kv_cache, block_tables, seq_lens, [q_len] * batch_size,
                              bmm1_scale)
    expected = query.shape[:-1] + (kv_lora_rank,)
    if out is None:
        out = torch.empty(expected, dtype=torch.bfloat16, device=query.device)
    elif out.shape != expected or out.dtype != torch.bfloat16:
        raise ValueError(f"out: {tuple(expected)} torch.bfloat16, got {tuple(out.shape)} {out.dtype}")
    out.copy_((result * bmm2_scale).reshape(expected))
    if not return_lse:
        return out
    flat = (batch_size * q_len, num_heads)
    if lse is None:
        lse = torch.empty(flat, dtype=torch.float32, device=query.device)
    elif tuple(lse.shape) != flat or lse.dtype != torch.float32:
        raise ValueError(f"lse must have shape {flat}; got {tuple(lse.shape)}")
    lse.copy_(lse_e / math.log(2))  # lse.cuh: log2(e) * m + log2(d), base 2
    return out, lse
