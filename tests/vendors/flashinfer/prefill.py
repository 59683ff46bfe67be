"""Fake flashinfer.prefill (0.6.14): BatchPrefillWithPagedKVCacheWrapper's __init__/plan/run with the
shipped signatures, checks, plan-then-run state and layouts; paged attention over the planned CSR page
lists (causal bottom-right, window_left, logits_soft_cap, sinks) written here independently, in fp64."""
import math

import torch

CALLS = []
HEAD_DIMS = (64, 128, 256)  # what the fa3 paged prefill module of sm_90 is built for
CAPABILITY = (9, 0)  # the device the fake stands for: "auto" is fa3 on sm_90, fa2 elsewhere


def _dtype(value):
    return getattr(torch, value) if isinstance(value, str) else value


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        if kv_layout not in ("NHD", "HND"):
            raise KeyError(f"Invalid kv_layout {kv_layout}")
        if use_cuda_graph or jit_args is not None or backend not in ("auto", "fa2", "fa3"):
            raise NotImplementedError("the fake models the eager fa2/fa3 wrapper only")
        CALLS.append(dict(entry="BatchPrefillWithPagedKVCacheWrapper", kv_layout=kv_layout))
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_layout = kv_layout
        self.device = float_workspace_buffer.device
        self._plan_info = None
        self._backend = ("fa3" if CAPABILITY == (9, 0) else "fa2") if backend == "auto" else backend

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len=0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv=False,
    ):
        q_data_type = _dtype(q_data_type)
        kv_data_type = q_data_type if kv_data_type is None else _dtype(kv_data_type)
        o_data_type = q_data_type if o_data_type is None else _dtype(o_data_type)
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        CALLS.append(dict(entry="BatchPrefillWithPagedKVCacheWrapper.plan", causal=causal, sm_scale=sm_scale,
                          window_left=window_left, logits_soft_cap=logits_soft_cap, page_size=page_size,
                          q_data_type=q_data_type, kv_data_type=kv_data_type))
        if custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode != "NONE" \
                or prefix_len_ptr is not None:
            raise NotImplementedError("the fake has no custom masks, rope or multi-item scoring")
        if q_data_type not in (torch.float16, torch.bfloat16) or kv_data_type != q_data_type:
            raise NotImplementedError(f"the fake takes fp16/bf16 q and kv of q's dtype, got {q_data_type}, "
                                      f"{kv_data_type}")
        batch = len(qo_indptr) - 1
        for name, tensor, size in (("qo_indptr", qo_indptr, batch + 1), ("paged_kv_indptr", paged_kv_indptr, batch + 1),
                                   ("paged_kv_last_page_len", paged_kv_last_page_len, batch)):
            if tensor.dtype != torch.int32 or tensor.dim() != 1 or tensor.shape[0] != size:
                raise TypeError(f"{name}: int32 [{size}], got {tensor.dtype} {tuple(tensor.shape)}")
        if paged_kv_indices.dtype != torch.int32 or paged_kv_indices.dim() != 1:
            raise TypeError(f"paged_kv_indices: int32 1-D, got {paged_kv_indices.dtype} "
                            f"{tuple(paged_kv_indices.shape)}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if head_dim_qk not in HEAD_DIMS or head_dim_vo != head_dim_qk:
            raise ValueError(f"head_dim {head_dim_qk}/{head_dim_vo}: no prefill module for it")
        qo_host, kv_host = qo_indptr.to("cpu"), paged_kv_indptr.to("cpu")
        last_host = paged_kv_last_page_len.to("cpu")
        if int(qo_host[0]) != 0 or int(kv_host[0]) != 0 or (qo_host.diff() < 0).any() or (kv_host.diff() < 0).any():
            raise ValueError("qo_indptr / paged_kv_indptr must start at 0 and never decrease")
        if int(kv_host[-1]) > paged_kv_indices.shape[0]:
            raise ValueError(f"paged_kv_indices holds {paged_kv_indices.shape[0]} < paged_kv_indptr[-1] pages")
        pages = kv_host.diff()
        if ((pages > 0) & ((last_host < 1) | (last_host > page_size))).any():
            raise ValueError("1 <= paged_kv_last_page_len <= page_size for every request with pages")
        self._batch_size = batch
        self._num_qo_heads, self._num_kv_heads = num_qo_heads, num_kv_heads
        self._head_dim, self._page_size = head_dim_qk, page_size
        self._qo_indptr = qo_host.tolist()
        self._kv_indptr = kv_host.tolist()
        self._kv_indices = paged_kv_indices.to(self.device)
        self._last_page_len = last_host.tolist()
        self._cached_q_data_type = q_data_type
        self._cached_kv_data_type = kv_data_type
        self._cached_o_data_type = o_data_type
        self._causal = causal
        self._window_left = window_left
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else logits_soft_cap
        self._sm_scale = sm_scale
        self._plan_info = object()

    begin_forward = plan

    def run(
        self,
        q,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
    ):
        if isinstance(paged_kv_cache, tuple):
            k_cache, v_cache = paged_kv_cache
        else:
            k_cache, v_cache = paged_kv_cache.unbind(dim=1)
        # As the shipped one: the planned dtypes are read first, so run() before plan() raises.
        if q.dtype != self._cached_q_data_type:
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type "
                             f"{self._cached_q_data_type} specified in plan function.")
        if k_cache.dtype != self._cached_kv_data_type or v_cache.dtype != self._cached_kv_data_type:
            raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type "
                             f"{self._cached_kv_data_type} specified in plan function.")
        CALLS.append(dict(entry="BatchPrefillWithPagedKVCacheWrapper.run", tokens=q.shape[0]))
        if q.size(0) != self._qo_indptr[-1]:
            raise ValueError(f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({self._qo_indptr[-1]}).")
        if kv_cache_sf is not None or args:
            raise NotImplementedError("the fake has no NVFP4 KV cache or custom-kernel arguments")
        window_left = self._window_left if window_left is None else window_left
        assert window_left == self._window_left
        if self._kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(-3, -2), v_cache.transpose(-3, -2)
        heads, kv_heads, head_dim, page_size = self._num_qo_heads, self._num_kv_heads, self._head_dim, self._page_size
        if q.dim() != 3 or tuple(q.shape[1:]) != (heads, head_dim) or q.stride(-1) != 1:
            raise ValueError(f"q: [tokens, {heads}, {head_dim}] with a unit last stride, got {tuple(q.shape)}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or tuple(cache.shape[1:]) != (page_size, kv_heads, head_dim) or cache.stride(-1) != 1:
                raise ValueError(f"{name}: [num_pages, {page_size}, {kv_heads}, {head_dim}] ({self._kv_layout}) with "
                                 f"a unit last stride, got {tuple(cache.shape)} strides {cache.stride()}")
        if self._backend == "fa2":  # batch_prefill.cu addresses V with K's strides and checks them
            for i in range(k_cache.dim()):
                if k_cache.stride(i) != v_cache.stride(i):
                    raise ValueError(f"k/v strides differs at {i}")
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,)):
            raise TypeError(f"sinks: fp32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
        if out is None:
            out = torch.zeros(q.shape, dtype=self._cached_o_data_type, device=q.device)
        elif out.shape != q.shape or out.dtype != self._cached_o_data_type:
            raise ValueError(f"out: {tuple(q.shape)} {self._cached_o_data_type}, got {tuple(out.shape)} {out.dtype}")
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        sm_scale = 1.0 / math.sqrt(head_dim) if self._sm_scale is None else self._sm_scale
        for factor in (q_scale, k_scale):
            if factor is not None:
                sm_scale *= float(factor)
        group, cap = heads // kv_heads, self._logits_soft_cap
        for b in range(self._batch_size):
            start, end = self._qo_indptr[b], self._qo_indptr[b + 1]
            q_len, num_pages = end - start, self._kv_indptr[b + 1] - self._kv_indptr[b]
            kv_len = (num_pages - 1) * page_size + self._last_page_len[b] if num_pages else 0
            if q_len == 0:
                continue
            if kv_len == 0:  # nothing to see (non-causal): zeros and an lse of -inf, as the kernels write
                out[start:end] = 0
                if return_lse:
                    lse[start:end] = -math.inf
                continue
            ids = self._kv_indices[self._kv_indptr[b]: self._kv_indptr[b + 1]].long()
            k = k_cache[ids].to(torch.float64).reshape(-1, kv_heads, head_dim)[:kv_len]
            v = v_cache[ids].to(torch.float64).reshape(-1, kv_heads, head_dim)[:kv_len]
            query = q[start:end].to(torch.float64).view(q_len, kv_heads, group, head_dim)
            logits = torch.einsum("qkgd,lkd->kgql", query, k) * sm_scale  # [Hkv, group, q_len, kv_len]
            if cap > 0:
                logits = cap * torch.tanh(logits / cap)
            row = torch.arange(q_len)[:, None] + (kv_len - q_len)  # the query's kv position
            col = torch.arange(kv_len)[None, :]
            visible = torch.ones(q_len, kv_len, dtype=torch.bool)
            if self._causal:
                visible &= col <= row
            if window_left >= 0:
                visible &= col >= row - window_left
            logits = logits.masked_fill(~visible, -math.inf)
            top = logits.amax(dim=-1, keepdim=True)
            if sinks is not None:
                sink = sinks.to(torch.float64).view(kv_heads, group, 1, 1)
                top = torch.maximum(top, sink)
            top = torch.where(torch.isinf(top), 0.0, top)
            weights = torch.exp(logits - top)
            total = weights.sum(dim=-1, keepdim=True)
            if sinks is not None:
                total = total + torch.exp(sink - top)
            # A row that sees nothing writes zeros (and lse -inf), as the kernels do.
            values = torch.einsum("kgql,lkd->qkgd", weights / total.clamp_min(1e-300), v)
            out[start:end] = values.reshape(q_len, heads, head_dim).to(out.dtype)
            if return_lse:
                lse[start:end] = ((top + total.log()) / math.log(2)).reshape(heads, q_len).T.float()  # base 2
        if v_scale is not None and not (isinstance(v_scale, float) and v_scale == 1.0):
            out *= v_scale
        return (out, lse) if return_lse else out
