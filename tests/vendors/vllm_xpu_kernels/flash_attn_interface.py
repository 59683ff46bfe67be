"""Fake vllm-xpu-kernels 0.1.16.2: flash_attn_varlen_func with the shipped signature and the wrapper's own checks,
handing the call to varlen_fwd. Where the real one catches "not compiled" and falls back to its PyTorch
reference, the fake raises; its speculative-decode route is left to varlen_fwd (the same attention)."""

from typing import Optional

import torch

try:
    from . import _vllm_fa2_C  # noqa: F401 - registers torch.ops._vllm_fa2_C
    FA2_UNAVAILABLE_REASON = None
    FA2_AVAILABLE = True
except ImportError as error:
    FA2_UNAVAILABLE_REASON = str(error)
    FA2_AVAILABLE = False

DEFAULT_FA_VERSION = 2
COPIES = []  # the tensors the wrapper made contiguous (a cache copied per call), by name


def _descale(descale, name):
    if descale is None:
        return None
    assert descale.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        f"{name} must be a float32 or bfloat16 or float16 scalar tensor view")
    assert descale.untyped_storage().nbytes() == descale.element_size(), f"{name} must be view of single scalar tensor"
    if descale.dtype == torch.float32:
        return descale
    value = descale.flatten()[0].to(torch.float32)
    return value if descale.ndim == 0 else value.expand(descale.shape)


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size: Optional[list[int]] = None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    fa_version: int = DEFAULT_FA_VERSION,
    s_aux: Optional[torch.Tensor] = None,
    num_splits_kv: Optional[int] = None,
    is_mix_batch: bool = True,
    host_kv_lens: Optional[torch.Tensor] = None,
):
    if host_kv_lens is not None:
        if seqused_k is not None:
            raise ValueError("Provide only one of host_kv_lens and seqused_k")
        seqused_k = torch.as_tensor(host_kv_lens, dtype=torch.int32, device=q.device)
    assert cu_seqlens_k is not None or seqused_k is not None, "cu_seqlens_k or seqused_k must be provided"
    assert cu_seqlens_k is None or seqused_k is None, "cu_seqlens_k and seqused_k cannot be provided at the same time"
    assert block_table is None or seqused_k is not None, "when enable block_table, seqused_k is needed"
    assert block_table is not None or cu_seqlens_k is not None, "when block_table is disabled, cu_seqlens_k is needed"
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    q_descale = _descale(q_descale, "q_descale")
    k_descale = _descale(k_descale, "k_descale")
    v_descale = _descale(v_descale, "v_descale")
    left, right = (-1, -1) if window_size is None else (window_size[0], window_size[1])
    tensors = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            COPIES.append(name)
            x = x.contiguous()
        tensors[name] = x
    if fa_version != 2:
        raise NotImplementedError("not support yet")
    if num_splits > 1:
        raise NotImplementedError("FA2 does not support num_splits > 1")
    if scheduler_metadata is not None:
        raise NotImplementedError("FA2 does not support scheduler_metadata")
    if (k_descale is None) != (v_descale is None):
        raise NotImplementedError("FA2 only supports both KV cache descaled")
    dummy_cu_seqlens_k = torch.zeros_like(cu_seqlens_q)
    out, softmax_lse = torch.ops._vllm_fa2_C.varlen_fwd(
        tensors["q"], tensors["k"], tensors["v"], out, cu_seqlens_q,
        dummy_cu_seqlens_k if cu_seqlens_k is None else cu_seqlens_k, seqused_k, None, block_table, alibi_slopes,
        max_seqlen_q, max_seqlen_k, dropout_p, q_descale, k_descale, v_descale, softmax_scale, s_aux, False, causal,
        left, right, softcap, return_softmax_lse, None, num_splits_kv, is_mix_batch, None, None,
    )
    return (out, softmax_lse) if return_softmax_lse else out
