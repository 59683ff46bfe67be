"""Host side of the cuda backend's paged-attention prefill on Hopper (kernels/paged_prefill_sm90.cu,
16-bit caches, head dim 128, ``max_query_len > 1``): what it takes, its plan, and its launch, one CTA
per query head, 128-query tile and sequence, sized from host ints only (CUDA-graph safe)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda._layout import page_shift
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import paged_attention as paged_spec

__all__ = ["CAPABILITY", "HEAD_DIM", "PrefillPlan", "override_plan", "paged_prefill", "prefill_supports",
           "kernel_name", "shape_reason", "shared_bytes"]

CAPABILITY = HOPPER  # wgmma and setmaxnreg: sm_90a cubins run on sm_90 only
HEAD_DIM = 128  # the tiles' layout (two 64-dim column blocks)
ROWS = 128  # query rows per CTA: two consumer warpgroups of 64
THREADS = 384  # a producer warpgroup and two consumers
TILE_BYTES = 128 * HEAD_DIM * 2
STAGES = (2, 3)  # K/V stages the kernel is instantiated for (3 fills 225 KiB of the 227)
SOURCE_NAME = "paged_prefill_sm90.cu"
_LOG2E = 1.4426950408889634

_capability = probes.device_capability


def shared_bytes(stages: int) -> int:
    """shared_bytes<STAGES>() in the .cu file: the query tile, ``stages`` K and V tiles, and 1024
    bytes of room to align the base (the kernel traps when launched with less)."""
    return (1 + 2 * stages) * TILE_BYTES + 1024


@dataclass(frozen=True)
class PrefillPlan:
    """A launch's choices: K/V stages in shared memory (one of STAGES); whether each consumer
    issues the next step's scores before waiting for this step's values (``overlap``: the
    softmax runs under the value MMAs); and, with overlap, whether the two consumers take turns
    to issue their MMAs (``pingpong``: one's softmax under the other's MMAs)."""

    # Three stages with overlap, no ping-pong: fastest at Llama-3-8B 8192 on the H100 in
    # perf/diag/cuda_prefill_sweep.py (perf/decisions/paged_attention.md); ping-pong gained
    # nothing once the overlap overlapped, so it is off.
    stages: int = 3
    overlap: bool = True
    pingpong: bool = False


DEFAULT_PLAN = PrefillPlan()


def _plan_problem(plan: PrefillPlan) -> Optional[str]:
    if plan.stages not in STAGES:
        return f"stages must be one of {STAGES}, got {plan.stages!r}"
    for field in ("overlap", "pingpong"):
        if type(getattr(plan, field)) is not bool:
            return f"{field} must be a bool, got {getattr(plan, field)!r}"
    if plan.pingpong and not plan.overlap:
        return "pingpong needs overlap (the kernel's ping-pong is written for the overlapped loop)"
    return None


_plans = PlanSetting("override_plan", DEFAULT_PLAN, _plan_problem)
override_plan = _plans.override_fields


def shape_reason(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                 block_size: int) -> Optional[str]:
    """Why the prefill kernel does not take a call of this kind (None when it does); no device
    needed."""
    if query_dtype not in (torch.bfloat16, torch.float16):
        return f"prefill: bf16 or fp16 queries only, got {query_dtype}"
    if cache_dtype != query_dtype:
        return (f"prefill: caches of the query's dtype ({query_dtype}) only, this cache is {cache_dtype} "
                "(fp8 caches: the triton backend)")
    if head_dim != HEAD_DIM:
        return f"prefill: head dim {HEAD_DIM} only (the tiles' layout), got {head_dim}"
    if page_shift(block_size) is None:
        return f"prefill: power-of-two cache block sizes only, got {block_size}"
    return None


def prefill_supports(key: paged_spec.Key, platform: Platform) -> Optional[str]:
    """None when the prefill kernel handles calls with this dispatch key on ``platform``, else
    why not; the tensors' layouts are paged_attention.py's check, shared with the decode kernel."""
    reason = shape_reason(key.query_dtype, key.cache_dtype, key.head_dim, key.block_size)
    if reason is not None:
        return reason
    if not (math.isfinite(key.scale) and key.scale > 0):
        # The kernel takes each row's maximum over raw scores and scales it once.
        return f"prefill: scale must be finite and > 0, got {key.scale}"
    if platform.capability != CAPABILITY:
        return (f"prefill needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper: the kernel is built on its wgmma), "
                f"this GPU is {platform.arch}")
    if key.num_seqs_class > 65535:
        return (f"up to {key.num_seqs_class} sequences (this batch's size class) > 65535, CUDA's limit on grid "
                "axis 2 (split the batch)")
    if math.ceil(key.max_query_len_class / ROWS) > 65535:
        return (f"max_query_len up to {key.max_query_len_class} (its size class) > {65535 * ROWS}, CUDA's limit "
                "on grid axis 1 in 128-query tiles")
    return None


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], bf16: bool, soft_cap: bool,
              plan: PrefillPlan) -> tuple[_compile.CompiledModule, str]:
    """One NVRTC compilation per arch, macro set and template set: (module, kernel name)."""
    name = kernel_name(bf16, soft_cap, plan)
    module = _compile.compile_module_cached(source([name]), [name], arch, filename=SOURCE_NAME,
                                            arch_specific=True, defines=defines)
    return module, name


def kernel_name(bf16: bool, soft_cap: bool, plan: PrefillPlan) -> str:
    """The C++ name of the kernel instantiated for a query dtype, soft cap or not, and a plan."""
    flags = ", ".join(str(flag).lower() for flag in (bf16, soft_cap))
    return (f"paged_prefill_sm90<{flags}, {plan.stages}, {str(plan.overlap).lower()}, "
            f"{str(plan.pingpong).lower()}>")


def source(names: list[str]) -> str:
    """kernels/paged_prefill_sm90.cu with the named ABI's checks for the kernels ``names``."""
    return _params.checked_source(SOURCE_NAME, [(_params.PagedPrefillParams, names)])


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, bf16: bool, soft_cap: bool, plan: PrefillPlan) -> _driver.Kernel:
    """The prefill kernel for the template set, loaded on ``device`` (cached per device and
    diagnostic macros)."""
    defines = _compile.diagnostics_in_force()

    def build():
        module, name = _compiled(_capability(device), defines, bf16, soft_cap, plan)
        return module, [_driver.KernelSpec(name, _params.PagedPrefillParams, THREADS, shared_bytes(plan.stages))]

    return _LOADED.get(device, (defines, bf16, soft_cap, plan), build)[0]


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    logits_soft_cap: float,
    sinks: Optional[torch.Tensor],
) -> torch.Tensor:
    """The spec's paged_attention for a batch with prefill queries, on the wgmma kernel;
    arguments are validated by the caller and accepted by prefill_supports (and paged_attention.py's
    alignment check)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_q_heads, _ = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0 or max_query_len == 0 or num_seqs == 0:
        return out.zero_()
    plan = _plans.current
    soft_cap = logits_soft_cap > 0
    device = query.device
    with torch.cuda.device(device):
        kernel = _kernel(device, query.dtype == torch.bfloat16, soft_cap, plan)
        kernel(
            (num_q_heads, math.ceil(max_query_len / ROWS), num_seqs),
            # PDL (sm_90a always has it): the launch hides under the previous kernel's end.
            overlap_previous=True,
            query=query, k_cache=k_cache, v_cache=v_cache, out=out, cu_seqlens_q=cu_seqlens_q,
            block_table=block_table, seq_lens=seq_lens, sinks=sinks, group=num_q_heads // num_kv_heads,
            page_shift=page_shift(k_cache.shape[1]), causal=int(causal), window=int(sliding_window),
            scale_log2=float(scale) / logits_soft_cap if soft_cap else float(scale) * _LOG2E,
            soft_cap=float(logits_soft_cap),
            q_stride_t=query.stride(0), q_stride_h=query.stride(1), o_stride_t=out.stride(0),
            o_stride_h=out.stride(1), k_stride_b=k_cache.stride(0), k_stride_p=k_cache.stride(1),
            k_stride_h=k_cache.stride(2), v_stride_b=v_cache.stride(0), v_stride_p=v_cache.stride(1),
            v_stride_h=v_cache.stride(2), table_stride=block_table.stride(0),
        )
    return out
