"""The flashinfer backend's mla_decode over kernelmux's 576-wide latent cache. On sm_90 (and every
major but 10 and 12): ``BatchMLAPagedAttentionWrapper`` (fa3 on sm_90, fa2 elsewhere), read as its
c_kv and k_pe column views; the wrapper plans on the host at every call. On a major of 10 (sm_100,
sm_103) and 12 (sm_120, sm_121): ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla``, asked for
by name (backend "trtllm-gen" on 10, "xqa" on 12), which reads kernelmux's block table and seq_lens
as they are: no plan, no host sync, so it can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.backends.flashinfer._paged import HOST_PLAN, page_lists, refuse_capture, workspace, wrapper
from kernelmux.platforms import Platform
from kernelmux.specs import mla_decode as spec

__all__ = ["metadata", "mla_decode", "supports"]

LN2 = 0.6931471805599453  # base-2 lse times ln 2: the natural-log lse the spec returns
RANK, ROPE = 512, 64  # DeepSeek's c_kv and k_pe widths: the heads the fa2/fa3 MLA modules are built for
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"


# The majors trtllm_batch_decode_with_kv_cache_mla is asked for on, and its backend there (mla/_core.py:
# "auto" is trtllm-gen or cute-dsl, by autotuning, on 10 and xqa on 12; the adapter names the one it is
# written for, so cute-dsl never runs unasked).
TRTLLM_BACKENDS = {10: "trtllm-gen", 12: "xqa"}
TRTLLM_GEN_BLOCK_SIZES = (32, 64)  # _core.py: "trtllm-gen requires block_size in (32, 64)"
XQA_BLOCK_SIZES = (16, 32, 64, 128)  # xqa.py, xqa_mla: "page_size ... Must be one of [16, 32, 64, 128]"
XQA_HEADS = 128  # xqa.py: "XQA MLA only supports 128 query heads (head_group_ratio=128)"
# FlashInfer's own tests check trtllm-gen MLA against the causal fa2 wrapper for 1 and 2 queries per
# request only ("todo(Yingyi): verify larger q_len_per_request", tests/attention/test_trtllm_gen_mla.py),
# and its MLA generation kernels run with a "Dense" mask type (trtllm_fmha_kernel_launcher.cu).
TRTLLM_GEN_MAX_QUERY_LEN = 2


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when FlashInfer's MLA entry point of this platform computes calls with this dispatch key as
    the spec defines."""
    if platform.capability < (8, 0):
        return f"BatchMLAPagedAttentionWrapper needs sm_80 or newer, not {platform.arch}"
    if key.width != RANK + ROPE or key.kv_lora_rank != RANK:
        return f"rows of {RANK + ROPE} with kv_lora_rank {RANK} only (DeepSeek MLA), got {key.width} and {key.kv_lora_rank}"
    if key.q_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 q only, got {key.q_dtype}"
    if key.cache_dtype != key.q_dtype:
        # Its fp8 path (fa3, sm_90, bf16 q) ran on the H100 with every lse 2.5e-3 relative off (0.035
        # absolute, DeepSeek-V3 16 and 128 heads, B 8-128 x 4096); the spec allows 1e-5. On sm_100/sm_120
        # the fp8 paths quantize q (trtllm-gen takes an fp8 cache with an fp8 query) or P (xqa's
        # mla_sm120.cu packs the softmax to e4m3 before P @ V): outside ATTENTION_OUTPUT.
        return f"a cache of q's dtype ({key.q_dtype}) only; fp8 caches disagree with the reference, got {key.cache_dtype}"
    for name in ("q", "kv_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} needs a unit stride along its last dim, got {getattr(key, name + '_layout')}"
    backend = TRTLLM_BACKENDS.get(platform.capability[0])
    if backend is None:
        return None
    return _trtllm_reason(key, backend)


def _trtllm_reason(key: spec.Key, backend: str) -> Optional[str]:
    """Why trtllm_batch_decode_with_kv_cache_mla(backend=backend) cannot take calls with this key."""
    where = f"trtllm_batch_decode_with_kv_cache_mla (backend {backend!r})"
    if key.q_dtype != torch.bfloat16:
        # _core.py: out is checked against torch.bfloat16 (and allocated so); xqa: "(bfloat16, bfloat16) only".
        return f"{where}: bf16 q and cache only (its out is bf16), got {key.q_dtype}"
    for name in ("q", "kv_cache"):
        if not getattr(key, f"{name}_layout").dense_rows:
            return f"{where}: {name} needs 16-byte aligned rows (TMA), got {getattr(key, name + '_layout')}"
    if backend == "xqa":
        if key.block_size not in XQA_BLOCK_SIZES:
            return f"{where}: block_size in {XQA_BLOCK_SIZES} only, got {key.block_size}"
        if key.num_heads != XQA_HEADS:
            return f"{where}: XQA MLA only supports {XQA_HEADS} query heads, got {key.num_heads}"
        if key.max_query_len != 1 or not key.uniform_queries:
            return (f"{where}: XQA MLA only supports q_len_per_request == 1 (one query per sequence), "
                    f"got max_query_len {key.max_query_len}, uniform {key.uniform_queries}")
        if key.return_lse:
            return f"{where}: XQA MLA backend does not support return_lse/lse output"
        return None
    if key.block_size not in TRTLLM_GEN_BLOCK_SIZES:
        return f"{where}: trtllm-gen requires block_size in {TRTLLM_GEN_BLOCK_SIZES}, got {key.block_size}"
    if key.max_query_len > TRTLLM_GEN_MAX_QUERY_LEN:
        return (f"{where}: up to {TRTLLM_GEN_MAX_QUERY_LEN} queries per sequence (the causal MTP case FlashInfer "
                f"verifies), got max_query_len {key.max_query_len}")
    if key.return_lse and not key.uniform_queries:
        # Varying query counts go through cum_seq_lens_q: "trtllm-gen MLA does not support return_lse/lse
        # with cum_seq_lens_q".
        return f"{where}: no lse with varying queries per sequence (cum_seq_lens_q)"
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device``; (0, 0) off CUDA (the wrapper path)."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def capture_check(key: spec.Key, platform: Platform) -> Optional[str]:
    """The trtllm entry points of sm_100/sm_120 plan nothing and can be captured in a CUDA graph;
    elsewhere BatchMLAPagedAttentionWrapper plans on the host at every call."""
    if (platform.capability or (0, 0))[0] in TRTLLM_BACKENDS:
        return None
    return f"BatchMLAPagedAttentionWrapper: {HOST_PLAN}"


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: the block table's
    conversion to page lists and the wrapper's plan (a host sync). Nothing on sm_100/sm_120, where
    trtllm_batch_decode_with_kv_cache_mla plans nothing."""
    q = kwargs["q"]
    if q.shape[0] == 0 or _capability(q.device)[0] in TRTLLM_BACKENDS:
        return None
    return _plan(q, kwargs["kv_cache"], kwargs["cu_seqlens_q"], kwargs["block_table"], kwargs["seq_lens"],
                 kwargs["scale"])


def _plan(q, kv_cache, cu_seqlens_q, block_table, seq_lens, scale):
    """The MLA wrapper of this device, planned for this batch."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    block_size = kv_cache.shape[1]
    pages = page_lists(block_table, seq_lens, block_size)
    mla = wrapper(q.device, "mla", lambda buffer: BatchMLAPagedAttentionWrapper(float_workspace_buffer=buffer))
    mla.plan(
        qo_indptr=cu_seqlens_q.to(torch.int32), kv_indptr=pages.indptr, kv_indices=pages.indices,
        kv_len_arr=seq_lens.to(torch.int32), num_heads=q.shape[1], head_dim_ckv=RANK, head_dim_kpe=ROPE,
        page_size=block_size, causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
    )
    return mla


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
    """The spec's mla_decode on FlashInfer's MLA wrapper; arguments are validated by the caller and
    accepted by ``supports``."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    device = q.device
    if num_tokens == 0:
        return (torch.empty((0, num_heads, RANK), dtype=q.dtype, device=device),
                torch.empty((0, num_heads) if return_lse else (0,), dtype=torch.float32, device=device))
    backend = TRTLLM_BACKENDS.get(_capability(device)[0])
    if backend is not None:
        return _trtllm(backend, q, kv_cache, cu_seqlens_q, block_table, seq_lens, max_query_len, max_seq_len,
                       scale, return_lse)
    refuse_capture("flashinfer's MLA wrapper")
    variant = (q.dtype, kv_cache.dtype, num_heads)

    def call():
        mla = _plan(q, kv_cache, cu_seqlens_q, block_table, seq_lens, scale)
        return mla.run(q_nope=q[..., :RANK], q_pe=q[..., RANK:], ckv_cache=kv_cache[..., :RANK],
                       kpe_cache=kv_cache[..., RANK:], return_lse=return_lse, return_lse_base_on_e=True)

    result = first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
    if return_lse:
        return result
    return result, torch.empty((0,), dtype=torch.float32, device=device)


def _trtllm(backend, q, kv_cache, cu_seqlens_q, block_table, seq_lens, max_query_len, max_seq_len, scale,
            return_lse):
    """The spec's mla_decode on trtllm_batch_decode_with_kv_cache_mla: device ops only around it.

    Every sequence with ``q_len`` queries (decode, or MTP with one count): q as ``[B, q_len, H, 576]``,
    its out ``[B, q_len, H, 512]`` and lse ``[B * q_len, H]`` in kernelmux's token order. Varying
    counts (trtllm-gen only): q flat with ``cum_seq_lens_q`` and ``max_q_len``, which spares the
    vendor its host-side check of cum_seq_lens_q."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_seqs, block_size = seq_lens.shape[0], kv_cache.shape[1]
    device = q.device
    uniform = num_tokens == num_seqs * max_query_len
    # _core.py: "block_num % (128 / block_size) == 0": the table's width padded (never read: only a row's
    # first ceil(L / block_size) ids are) to a multiple of 128 / block_size, as a contiguous int32 copy.
    multiple = max(1, 128 // block_size)
    table = block_table.to(torch.int32)
    table = torch.nn.functional.pad(table, (0, -table.shape[1] % multiple)).contiguous()
    flat = q.contiguous()  # xqa builds q's TMA descriptor for packed rows
    arguments = dict(
        kv_cache=kv_cache, workspace_buffer=workspace(device, "trtllm-mla"),
        qk_nope_head_dim=128,  # DeepSeek's; the dense paths do not read it ("TODO: remove in 1.0?")
        kv_lora_rank=RANK, qk_rope_head_dim=ROPE, block_tables=table,
        seq_lens=seq_lens.to(torch.int32).contiguous(), max_seq_len=max_seq_len,
        # trtllm-gen: scaleSoftmaxLog2 = bmm1_scale * log2(e) (trtllm_fmha_kernel_launcher.cu); xqa:
        # qkScaleLog2e = q_scale * kv_scale * log2(e) (mla_sm120.cu), q_scale = bmm1, kv_scale = bmm2.
        bmm1_scale=float(scale), bmm2_scale=1.0, backend=backend, return_lse=return_lse,
    )
    if uniform:
        arguments["query"] = flat.view(num_seqs, max_query_len, num_heads, RANK + ROPE)
    else:
        arguments.update(query=flat, cum_seq_lens_q=cu_seqlens_q.to(torch.int32).contiguous(),
                         max_q_len=min(max_query_len, num_tokens))  # "max_q_len cannot exceed" T
    variant = (backend, q.dtype, num_heads, block_size, max_query_len if uniform else "varlen")

    def call():
        return trtllm_batch_decode_with_kv_cache_mla(**arguments)

    result = first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
    out, lse = result if return_lse else (result, None)
    out = out.reshape(num_tokens, num_heads, RANK)
    if lse is None:
        return out, torch.empty((0,), dtype=torch.float32, device=device)
    # trtllm-gen's lse is base 2: lse.cuh, ComputeLSEFromMDKernel writes log2(e) * m + log2(d).
    return out, lse.reshape(num_tokens, num_heads) * LN2
