"""Fake flashinfer.mla (0.6.14): BatchMLAPagedAttentionWrapper's __init__/plan/run (fa2/fa3) with the
shipped signatures, checks (planned dtypes, fp8 scales), plan-then-run state and strided c_kv / k_pe
views; absorbed MLA over the planned page lists written here independently, in fp64."""
import math

import torch

CALLS = []
CAPABILITY = (9, 0)  # the device the fake stands for: "auto" is fa3 on sm_90, fa2 elsewhere
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
