"""Fake flashinfer.decode (0.6.14): trtllm_batch_decode_with_kv_cache and its xqa path
(xqa_batch_decode_with_kv_cache) with the shipped signatures, argument checks and layouts; its
backend="auto" picks as the shipped one does (trtllm-gen on a major of 10, which the fake only records
and refuses, xqa elsewhere); the xqa kernel's math (q_scale, kv_scale, sliding window, sinks) written
here independently, in fp64."""
import math

import torch

CALLS = []
CAPABILITY = (9, 0)  # the device the fake stands for: "auto" is trtllm-gen on major 10, xqa elsewhere
SEMAPHORE_BYTES = 8 * 1024 * 1024
FP8 = torch.float8_e4m3fn


def trtllm_batch_decode_with_kv_cache(
    query,
    kv_cache,
    workspace_buffer,
    block_tables,
    seq_lens,
    max_seq_len,
    bmm1_scale=1.0,
    bmm2_scale=1.0,
    window_left=-1,
    out=None,
    out_dtype=None,
    o_sf_scale=None,
    o_sf_vec_size=None,
    sinks=None,
    kv_layout="HND",
    enable_pdl=None,
    backend="auto",
    q_len_per_req=1,
    o_scale=1.0,
    mask=None,
    max_q_len=None,
    cum_seq_lens_q=None,
    skip_softmax_threshold_scale_factor=None,
    kv_cache_sf=None,
    uses_shared_paged_kv_idx=True,
    lse=None,
    return_lse=False,
):
    if isinstance(kv_cache, tuple):
        k_cache, v_cache = kv_cache
    elif kv_cache.shape[1] == 1:
        k_cache, v_cache = kv_cache, kv_cache
    else:
        assert kv_cache.shape[1] == 2, "When kv_cache is a single tensor, the second dimension must be 1 or 2"
        k_cache, v_cache = kv_cache.unbind(dim=1)
    if (k_cache.dtype == torch.uint8 or v_cache.dtype == torch.uint8) and kv_cache_sf is None:
        raise ValueError("kv_cache_sf must be provided for NVFP4 KV cache.")
    if backend == "auto":
        backend = "trtllm-gen" if CAPABILITY[0] == 10 else "xqa"
    CALLS.append(dict(entry="trtllm_batch_decode_with_kv_cache", backend=backend, kv_layout=kv_layout,
                      window_left=window_left, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                      sinks=sinks is not None, out=out))
    if backend != "xqa":
        raise NotImplementedError(f"the fake models the xqa backend only, not {backend}")
    if out_dtype == "nvfp4":
        raise ValueError("xqa backend does not support nvfp4 output")
    if o_sf_scale is not None or o_sf_vec_size is not None:
        raise ValueError("xqa backend does not support o_sf_scale or o_sf_vec_size")
    if max_q_len is not None or cum_seq_lens_q is not None:
        raise ValueError("xqa backend does not support cum_seq_lens_q")
    if not uses_shared_paged_kv_idx:
        raise ValueError("xqa backend does not support uses_shared_paged_kv_idx=False")
    if return_lse or lse is not None:
        raise NotImplementedError("xqa backend does not support return_lse/lse output")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else query.dtype
    if out is None:
        out = torch.empty_like(query, dtype=out_dtype)
    return xqa_batch_decode_with_kv_cache(
        query=query, kv_cache=(k_cache, v_cache), kv_cache_sf=kv_cache_sf, workspace_buffer=workspace_buffer,
        block_tables=block_tables, seq_lens=seq_lens, max_seq_len=max_seq_len, bmm1_scale=bmm1_scale,
        bmm2_scale=bmm2_scale, window_left=window_left, out=out, sinks=sinks, kv_layout=kv_layout,
        enable_pdl=enable_pdl, q_len_per_req=q_len_per_req, o_scale=o_scale, mask=mask,
    )


def xqa_batch_decode_with_kv_cache(
    query,
    kv_cache,
    workspace_buffer,
    block_tables,
    seq_lens,
    max_seq_len,
    bmm1_scale=1.0,
    bmm2_scale=1.0,
    window_left=-1,
    out=None,
    sinks=None,
    kv_layout="NHD",
    enable_pdl=None,
    q_len_per_req=1,
    o_scale=1.0,
    mask=None,
    kv_cache_sf=None,
):
    if isinstance(kv_cache, tuple):
        k_cache, v_cache = kv_cache
    else:
        k_cache, v_cache = kv_cache.unbind(dim=1)
    if kv_cache_sf is not None:
        raise NotImplementedError("the fake has no NVFP4 KV cache")
    if kv_layout == "NHD":
        page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    elif kv_layout == "HND":
        num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    else:
        raise KeyError(kv_layout)
    head_dim = query.shape[-1]
    CALLS.append(dict(entry="xqa_batch_decode_with_kv_cache", page_size=page_size, num_kv_heads=num_kv_heads))
    if workspace_buffer.dtype != torch.uint8 or workspace_buffer.numel() <= SEMAPHORE_BYTES:
        raise TypeError(f"workspace_buffer: {workspace_buffer.dtype} x {workspace_buffer.numel()}, expected "
                        "uint8 bytes past the 8 MiB of semaphores")
    semaphore = workspace_buffer[:SEMAPHORE_BYTES]
    if semaphore.any():
        raise RuntimeError("workspace_buffer: the semaphores at its front must be zero at first use")
    # xqa's own scales, as the shipped wrapper derives them.
    kv_scale = bmm2_scale * o_scale
    q_scale = bmm1_scale / kv_scale * (head_dim ** 0.5)
    if q_len_per_req > 1:
        query = query.view(query.shape[0] // q_len_per_req, q_len_per_req, query.shape[1], query.shape[2])
    if out is None:
        out = torch.empty_like(query)
    _xqa(query.unsqueeze(1), k_cache, v_cache, block_tables, seq_lens.unsqueeze(1), out.unsqueeze(1),
         num_kv_heads, page_size, sinks.reshape(num_kv_heads, -1) if sinks is not None else None, q_scale, kv_scale,
         window_left + 1 if window_left >= 0 else 0, kv_layout, 1.0 / o_scale, q_len_per_req, mask)
    return out


def _value(scale, name):
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(f"{name}: a 1-element fp32 tensor or a float, got {scale.dtype} {tuple(scale.shape)}")
        return float(scale.reshape(()))
    if not isinstance(scale, float):
        raise TypeError(f"{name}: a float or a tensor, got {type(scale).__name__}")
    return scale


def _xqa(q, k_cache, v_cache, page_table, seq_lens, output, num_kv_heads, page_size, sinks, q_scale, kv_scale,
         sliding_win_size, kv_layout, rcp_out_scale, q_seq_len, mask):
    """The xqa kernel (mha.cu / mha_sm90.cu): logits = q.k * q_scale * (kv_scale if the cache is
    quantized) / sqrt(head_dim) over the raw cache values, out = softmax . v * (kv_scale if quantized;
    rcp_out_scale only for fp8 outputs, which the fake has none of); a sliding window keeps the last
    sliding_win_size positions; sinks join the denominator; an empty sequence leaves its rows 0. Both
    caches are addressed with k_cache's strides (xqa_wrapper.cu takes kv_stride_page/token/head from
    kCacheVLLM alone), as the kernel does."""
    if q_seq_len != 1 or mask is not None:
        raise NotImplementedError("the fake has no speculative decoding")
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(-3, -2), v_cache.transpose(-3, -2)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"Invalid dtype: {q.dtype} for XQA, only float16 and bfloat16 input are supported")
    if k_cache.dtype != v_cache.dtype:
        raise AssertionError("K and V cache must have the same dtype")
    if k_cache.dtype not in (q.dtype, FP8):
        raise TypeError(f"cache: {k_cache.dtype}, expected {q.dtype} or float8_e4m3fn")
    if output.dtype != q.dtype:
        raise AssertionError("Output and query must have the same dtype")
    if page_size not in (16, 32, 64, 128):
        raise ValueError(f"Invalid page_size: {page_size}, only 16, 32, 64, 128 are supported")
    batch, beam, num_q_heads, head_dim = q.shape
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise ValueError(f"Invalid head_dim: {head_dim}, must be divisible by 16 and in range [16, 256]")
    if beam != 1 or num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > 32:
        raise ValueError(f"q: {tuple(q.shape)} with {num_kv_heads} kv heads")
    if not q.is_contiguous() or not output.is_contiguous() or output.shape != q.shape:
        raise ValueError(f"q / output: contiguous {tuple(q.shape)}, got output {tuple(output.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[1:]) != (page_size, num_kv_heads, head_dim) or cache.stride(-1) != 1:
            raise ValueError(f"{name}: [num_pages, {page_size}, {num_kv_heads}, {head_dim}] with a unit stride "
                             f"along the head dim, got {tuple(cache.shape)} strides {cache.stride()}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch \
            or not page_table.is_contiguous():
        raise TypeError(f"page_table: contiguous int32 [{batch}, pages], got {page_table.dtype} "
                        f"{tuple(page_table.shape)}")
    if seq_lens.dtype != torch.uint32 or tuple(seq_lens.shape) != (batch, 1):
        raise TypeError(f"seq_lens: uint32 [{batch}, 1], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    group = num_q_heads // num_kv_heads
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_kv_heads, group)):
        raise TypeError(f"sinks: fp32 [{num_kv_heads}, {group}], got {sinks.dtype} {tuple(sinks.shape)}")
    # The kernel reads V at K's strides: the fake does too (out of V's storage: an error here, a wild
    # read there).
    v_cache = torch.as_strided(v_cache, v_cache.shape, k_cache.stride(), v_cache.storage_offset())
    quantized = k_cache.dtype == FP8
    q_scale, kv_scale = _value(q_scale, "q_scale"), _value(kv_scale, "kv_scale")
    qk_scale = q_scale * (kv_scale if quantized else 1.0) / math.sqrt(head_dim)
    vo_scale = kv_scale if quantized else 1.0
    max_seq_len = page_table.shape[1] * page_size
    for b in range(batch):
        length = int(seq_lens[b, 0].to(torch.int64))
        if not 0 <= length <= max_seq_len:
            raise ValueError(f"seq_lens[{b}] = {length} outside [0, {max_seq_len}]")
        if length == 0:
            output[b, 0] = 0
            continue
        pages = page_table[b, : (length + page_size - 1) // page_size].long()
        k = k_cache[pages].to(torch.float64).reshape(-1, num_kv_heads, head_dim)[:length]
        v = v_cache[pages].to(torch.float64).reshape(-1, num_kv_heads, head_dim)[:length]
        first = length - sliding_win_size if 0 < sliding_win_size < length else 0
        k, v = k[first:], v[first:]
        query = q[b, 0].to(torch.float64).view(num_kv_heads, group, head_dim)
        logits = torch.einsum("kgd,lkd->kgl", query, k) * qk_scale  # [Hkv, group, positions]
        top = logits.amax(dim=-1, keepdim=True)
        if sinks is not None:
            top = torch.maximum(top, sinks.to(torch.float64)[..., None])
        weights = torch.exp(logits - top)
        total = weights.sum(dim=-1, keepdim=True)
        if sinks is not None:
            total = total + torch.exp(sinks.to(torch.float64)[..., None] - top)
        values = torch.einsum("kgl,lkd->kgd", weights / total, v) * vo_scale
        output[b, 0] = values.reshape(num_q_heads, head_dim).to(output.dtype)
