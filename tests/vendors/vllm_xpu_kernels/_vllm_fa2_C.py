"""Fake vllm-xpu-kernels 0.1.16.2: the _vllm_fa2_C extension, registering varlen_fwd with the shipped schema,
mha_varlen_fwd's host checks, and a model of which kernel takes which sequence (the decode kernel one row
per sequence, whatever its query count); softcap accepted and applied nowhere; attention in fp32."""

import torch

from vllm_xpu_kernels._library import define

CALLS = []  # one dict per varlen_fwd call: how the kernels were asked
# flash_api.cpp: the paged-decode kernel takes every sequence, one query row each (row cu_seqlens_q[b]:
# paged_decode_kernel.hpp sets seq_len_qo = 1), unless the call is prefill-only (mix_batch false and
# max_seqlen_q > 1); with mix_batch it leaves sequences of more than one query to the chunk-prefill one.

HEAD_SIZES = (64, 96, 128, 192, 256, 512)  # the templated head sizes (chunk_prefill_configure.cmake)
FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK


def _stride_alignment(x, name):
    _check(x.stride(-1) == 1, f"{name} expects the last dim to be contiguous (stride==1), got {x.stride(-1)}")
    _check(x.shape[-1] * x.element_size() % 16 == 0, f"{name} last dim size={x.shape[-1]} is not 16-byte aligned")


def _page_strides(k, v):
    """check_paged_kv_cache_strides (paged_kv_utils.h)."""
    _check(k.stride(1) > 0 and k.stride(0) > 0, "Paged K sequence and page strides must be positive")
    _check(k.stride(0) % k.stride(1) == 0, "Paged K page stride must be divisible by K sequence stride")
    _check(v.stride(1) > 0 and v.stride(0) % v.stride(1) == 0,
           "Paged V page stride must be divisible by V sequence stride")
    _check(v.stride(0) // v.stride(1) == k.stride(0) // k.stride(1),
           "Paged K/V page strides must match in sequence-position units")


def _attend(q, keys, values, positions, causal, left, right, scale, k_scale, v_scale, sink):
    """q [n, Hq, D] at kv positions ``positions`` over keys/values [L, Hkv, D] (raw cache values);
    ``left``/``right`` -1 for unbounded. fp32; the fp8 K scale folded into the softmax scale and the V
    scale applied to the output, as the kernels do."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * (scale * (k_scale if k_scale is not None else 1.0))
    kv = torch.arange(keys.shape[0])[None, :]
    pos = positions[:, None]
    visible = torch.ones(scores.shape[1:], dtype=torch.bool)
    if causal:
        visible &= kv <= pos
    if left >= 0:
        visible &= kv >= pos - left
    if right >= 0:
        visible &= kv <= pos + right
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        column = sink.float()[:, None, None].expand(scores.shape[0], scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out * v_scale if v_scale is not None else out


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, q_scale, k_scale, v_scale, softmax_scale, softmax_sink,
               zero_tensors, is_causal, window_size_left, window_size_right, softcap, return_softmax, gen, num_splits,
               mix_batch, splits_per_seq, work_list):
    _check(q.dtype in (torch.float16, torch.bfloat16), "VLLM Kernel XPU only supports fp16 and bf16 type")
    _check(v.dtype == k.dtype, "key and value must have the same dtype")
    if k.dtype not in FP8:
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _stride_alignment(x, name)
    _check(q.dim() == 3, "query must be in ragged format")
    if block_table is None or alibi_slopes is not None or p_dropout or q_scale is not None or return_softmax:
        raise NotImplementedError("fake vllm_xpu_kernels: only paged attention without alibi, dropout, an fp8 "
                                  "query or the lse is modelled")
    _check(block_table.dtype == torch.int32, "page_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "page_table must have contiguous last dimension")
    _page_strides(k, v)
    for x, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        _check(x.is_contiguous(), f"{name} must be contiguous")
        _check(x.dtype == torch.int32, f"{name} must have dtype torch.int32")
    head_size = q.shape[-1]
    if head_size not in HEAD_SIZES:
        raise RuntimeError(f"Chunk prefill kernel tuple not compiled for this configuration (head size {head_size})")
    fp8 = k.dtype in FP8
    if fp8:
        # The kernels dereference the scales as float (chunk_prefill_mainloop.hpp, Fp8KV).
        assert k_scale is not None and v_scale is not None, "fake vllm_xpu_kernels: an fp8 cache needs both scales"
        assert k_scale.dtype == v_scale.dtype == torch.float32, "fake vllm_xpu_kernels: *scale_k is read as float"
    if softmax_sink is not None:
        # chunk_prefill.hpp: reinterpret_cast<ElementQ*>(args.sm_sink).
        assert softmax_sink.dtype == q.dtype, "fake vllm_xpu_kernels: the sinks are read in the query dtype"
        assert softmax_sink.is_contiguous() and softmax_sink.numel() == q.shape[1]
    assert seqused_k is not None and seqused_k.dtype == torch.int32 and seqused_k.is_contiguous()
    result = out if out is not None else torch.empty_like(q)
    prefill_only = not mix_batch and max_seqlen_q > 1
    starts, lengths = cu_seqlens_q.tolist(), seqused_k.tolist()
    num_tokens, block_size = q.shape[0], k.shape[1]
    ks = float(k_scale.flatten()[0]) if fp8 else None
    vs = float(v_scale.flatten()[0]) if fp8 else None
    decoded = 0
    for b, kv_len in enumerate(lengths):
        q_len = starts[b + 1] - starts[b]
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        keys = k[blocks].flatten(0, 1)[:kv_len]
        values = v[blocks].flatten(0, 1)[:kv_len]
        if not prefill_only and (max_seqlen_q <= 1 or q_len <= 1):
            # Paged decode: one row, at the sequence's last position, non-causal; a left window from there.
            row = starts[b]
            if row >= num_tokens:
                raise RuntimeError(f"fake vllm_xpu_kernels: the decode kernel writes row {row} of {num_tokens} "
                                   f"(sequence {b} has no query): out of bounds")
            left = -1  # flash_api.cpp: any window bound makes it local, an unbounded left is max_seqlen_k
            if window_size_left != -1 or window_size_right != -1:
                left = max_seqlen_k if window_size_left == -1 else window_size_left
            o = _attend(q[row:row + 1], keys, values, torch.tensor([kv_len - 1]), False, left, -1, softmax_scale,
                        ks, vs, softmax_sink)
            result[row:row + 1] = o.to(result.dtype)
            decoded += 1
            continue
        if q_len == 0:
            continue
        positions = torch.arange(kv_len - q_len, kv_len)
        o = _attend(q[starts[b]:starts[b + 1]], keys, values, positions, is_causal, window_size_left,
                    window_size_right, softmax_scale, ks, vs, softmax_sink)
        result[starts[b]:starts[b + 1]] = o.to(result.dtype)
    CALLS.append(dict(max_seqlen_q=max_seqlen_q, mix_batch=mix_batch, causal=is_causal,
                      window=(window_size_left, window_size_right), softcap=softcap, fp8=fp8,
                      sink=softmax_sink is not None, decoded=decoded))
    return [result, torch.empty(0)]


define("_vllm_fa2_C", "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor!? out, Tensor cu_seqlens_q, "
                      "Tensor cu_seqlens_k, Tensor? seqused_k, Tensor? leftpad_k, Tensor? block_table, "
                      "Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, float p_dropout, Tensor? q_scale, "
                      "Tensor? k_scale, Tensor? v_scale, float softmax_scale, Tensor? softmax_sink, bool zero_tensors, "
                      "bool is_causal, int window_size_left, int window_size_right, float softcap, "
                      "bool return_softmax, Generator? gen, int? num_splits, bool mix_batch, Tensor? splits_per_seq, "
                      "Tensor? work_list) "
                      "-> Tensor[]", varlen_fwd)
