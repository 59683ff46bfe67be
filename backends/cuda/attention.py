"""Host side of the cuda backend's paged_attention: the entry point for both of its kernels,
chosen by the host int ``max_query_len``, and the fp8 e4m3 decode kernel's launch (kernel:
paged_decode_fp8.cu, which says how it works). Batches with prefill queries go to the Hopper
prefill kernel (prefill.py).

Decode scope: one query per sequence (``max_query_len <= 1``), e4m3 K and V caches with any
power-of-two block size, GQA groups of up to 16 query heads per KV head, bf16 or fp16 queries,
and every option of the spec (sliding window, soft cap, sinks, k/v scales; causal or not is the
same at one query). Everything else (16-bit caches at decode, other head dims, and what
prefill.py declines) is the triton backend's: ``paged_attention_supports`` says why per call,
and dispatch moves on.

The launch plan comes from host ints only: one CTA per (KV head, sequence), of 16 warps (one per
SM) when those are fewer than the SMs and long enough (wide_split_count) and of 4 otherwise,
and, when the grid is short of one wave of the GPU (the driver's occupancy for the compiled
kernel times the SMs; for 16-warp CTAs, short of 45% of the SMs), KV splits merged by a second
kernel. On sm_90 and newer both kernels launch as programmatic dependents of the kernel before
them on the stream (PDL: each waits for that kernel's writes before its first read, and the
decode grid warms L2 for its first reads while it waits; a 16-warp unsplit grid, which leaves
SMs idle and has no merge after it, lets the next kernel launch at once, a split grid lets its
merge launch once every CTA is past its stream, and a merge grid of at most one CTA per SM lets
the next kernel launch at its start; _launches): measured 1-2 points at the 70B TP8 fp8 shapes
in rounds 14 and 15, and 1.5-7 more in round 16 (perf/notes/attention.md). The host reads no
device data, so CUDA graphs stay valid when lengths and tables change under them. First call per (GPU
arch, template set): one NVRTC compilation, 0.3-0.8 s on a 2-core VM for sm_90, kept on disk
(_nvrtc.compile_module_cached: later processes load the cubin), then one module load per
device. No autotuning: the warps, split counts and plan come from
perf/diag/cuda_decode_sweep.py's measurements (DEFAULT_PLAN, _warps, split_count,
wide_split_count).
"""

from __future__ import annotations

import functools
import math
import pathlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _nvrtc, prefill
from kernelmux.backends.cuda._layout import page_shift
from kernelmux.platforms import Platform, probes
from kernelmux.specs import paged_attention as paged_spec

__all__ = ["DecodePlan", "HEAD_DIM", "MAX_GROUP", "layout_reason", "override_plan", "paged_attention",
           "paged_attention_supports", "split_count", "wide_split_count"]

FP8 = torch.float8_e4m3fn
HEAD_DIM = 128  # the kernel's lane-to-dim maps are written for 128 dims
MAX_GROUP = 16  # query heads per KV head: two 8-column MMA tiles
MIN_CAPABILITY = (8, 9)  # cvt.rn.f16x2.e4m3x2 (sm_89+); movmatrix and mma.m16n8k16 are older
PDL_CAPABILITY = (9, 0)  # programmatic dependent launch (griddepcontrol)
# Splits: each share at least this many positions (two 32-position steps per warp of a 4-warp
# CTA: shorter shares spend more on partials and the merge than they gain), at most _MAX_SPLITS.
MIN_SPLIT_LEN = 256
_MAX_SPLITS = 64  # the merge kernel's kMaxSplits
# 16-warp CTAs (one per SM): a grid holding at least WIDE_UNSPLIT_FILL of the SMs does not split,
# and each CTA takes at least WIDE_MIN_SHARE positions (four 32-position steps a warp).
WIDE_UNSPLIT_FILL = 0.45
WIDE_MIN_SHARE = 2048
_SOURCE = pathlib.Path(__file__).with_name("paged_decode_fp8.cu")
# The kernels' arguments (see the .cu file): p pointer, i int32, q int64, f float32.
_DECODE_SIGNATURE = "pppppppppppp" + "iiiiii" + "iii" + "ff" + "qqqq" + "qqq" + "qqq" + "q"
_MERGE_SIGNATURE = "pppp" + "iiii" + "qq"
# Macros defined for the compilation (perf/diag/cuda_decode_trace.py sets KERNELMUX_DIAG_TRACE).
_DEFINES: tuple[str, ...] = ()


def split_count(ctas: int, slots: int, max_seq_len: int, min_split_len: int = MIN_SPLIT_LEN,
                max_splits: int = _MAX_SPLITS) -> int:
    """KV splits for ``ctas`` (KV heads x sequences here; the MLA kernel's are head tiles x
    tokens) on a GPU holding ``slots`` CTAs at once, each split at least ``min_split_len``
    positions. A grid of at least one wave never splits; a shorter one takes the split count
    whose grid finishes in the fewest waves' time (ceil(ctas * s / slots) waves of CTAs 1/s as
    long) and, of equals, the fewest splits (each adds partials to write and merge)."""
    most = min(max_seq_len // min_split_len, max_splits)
    if ctas <= 0 or ctas >= slots or most < 2:
        return 1
    return min(range(1, most + 1), key=lambda s: (math.ceil(ctas * s / slots) / s, s))


def wide_split_count(ctas: int, sms: int, max_seq_len: int) -> Optional[int]:
    """KV splits for ``ctas`` 16-warp CTAs (one per SM), or None where 4-warp CTAs serve the grid
    better: a grid of one CTA per SM or more, or one whose one-wave split would leave CTAs under
    WIDE_MIN_SHARE positions. Unsplit (1) while the grid holds WIDE_UNSPLIT_FILL of the SMs,
    else as many splits as fill one wave. Measured on the H100 with an fp8 cache, 8 query heads
    on 1 KV head (perf/notes/attention.md round 13): B 64 x 4096 unsplit 76% (2 splits 73.5,
    4-warp CTAs 72.5); B 48 x 4096 2 splits 68.7 (unsplit 66.4); B 8 x 32768 16 splits 74.2
    (4-warp CTAs 73.0); B 128 x 4096 unsplit 88 (4-warp 82.7); B 16-32 x 4096 4-warp CTAs ahead
    by 1-4 points (shares of 512-1024 positions)."""
    if ctas <= 0 or ctas >= sms:
        return None
    splits = 1 if ctas >= WIDE_UNSPLIT_FILL * sms else sms // ctas
    if splits > _MAX_SPLITS or max_seq_len < splits * WIDE_MIN_SHARE:
        return None
    return splits


@dataclass(frozen=True)
class DecodePlan:
    """A launch's choices: KV splits (None: split_count's or wide_split_count's), whether each
    warp reads the next step's K while this step's softmax and values run (``read_ahead``: more
    registers, 12 warps per SM instead of 16), warps per CTA (None: _warps' choice; a number
    is an upper bound, lowered where the kernel's registers allow fewer), and whether the kernels
    launch as programmatic dependents of the kernel before them (``overlap``; None: on sm_90 and
    newer, which have it), so a launch's latency hides under that kernel's last CTAs."""

    num_splits: Optional[int] = None
    read_ahead: bool = False
    warps: Optional[int] = None
    overlap: Optional[bool] = None


DEFAULT_PLAN = DecodePlan()


def _plan_problem(plan: DecodePlan) -> Optional[str]:
    splits = plan.num_splits
    if splits is not None and (type(splits) is not int or not 1 <= splits <= _MAX_SPLITS):
        return f"num_splits must be an int in [1, {_MAX_SPLITS}] or None, got {splits!r}"
    if plan.warps not in (None, 4, 8, 16):
        return f"warps must be 4, 8, 16 or None, got {plan.warps!r}"
    if plan.overlap not in (None, True, False):
        return f"overlap must be True, False or None, got {plan.overlap!r}"
    if plan.warps == 16 and plan.read_ahead:
        return "read_ahead needs more than 128 registers a thread: at most 8 warps with it, got 16"
    return None


_plans = PlanSetting("override_plan", DEFAULT_PLAN, _plan_problem)
override_plan = _plans.override_fields


def shape_reason(query_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, decode: bool) -> Optional[str]:
    """Why the decode kernel does not take a call of this kind (None when it does); no device
    needed."""
    if not decode:
        return "decode only (max_query_len <= 1): prefill is prefill.py's kernel"
    if cache_dtype != FP8:
        return f"fp8 e4m3 caches only, this cache is {cache_dtype} (16-bit caches: the triton backend)"
    if query_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 queries only, got {query_dtype}"
    if head_dim != HEAD_DIM:
        return f"head dim {HEAD_DIM} only (the kernel's fragment maps are fixed), got {head_dim}"
    group = num_heads // num_kv_heads
    if group > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head, got {group}"
    if page_shift(block_size) is None:
        return f"power-of-two cache block sizes only, got {block_size}"
    return None


def layout_reason(key: paged_spec.Key) -> Optional[str]:
    """Why the decode or the prefill kernel cannot read the call's tensors (None when both can):
    16-byte vector loads of the query and cache rows, and unit-stride reads of the batch
    description and the sinks."""
    for name in ("query", "k_cache", "v_cache"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along the head dim and 16-byte aligned data and row strides "
                    f"(the kernels' vector loads), got {tensor_layout}")
    for name in ("cu_seqlens_q", "block_table", "seq_lens", "sinks"):
        tensor_layout = getattr(key, f"{name}_layout")
        if tensor_layout is not None and not tensor_layout.unit_stride:
            return f"{name} needs a unit stride along its last dim (the kernels index it densely)"
    return None


def paged_attention_supports(key: paged_spec.Key, platform: Platform) -> Optional[str]:
    """None when one of the backend's kernels handles calls with this dispatch key on
    ``platform``, else why not."""
    if not key.decode:
        reason = prefill.prefill_supports(key, platform)
    else:
        reason = shape_reason(key.query_dtype, key.cache_dtype, key.num_heads, key.num_kv_heads, key.head_dim,
                              key.block_size, key.decode)
        if reason is None and key.num_seqs_class > 65535:
            reason = (f"up to {key.num_seqs_class} sequences (this batch's size class) > 65535, CUDA's limit "
                      "on grid axis 1 (split the batch)")
    return reason if reason is not None else layout_reason(key)


_capability = probes.device_capability
_sm_count = probes.compute_units


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...],
              *template: bool | int) -> tuple[_nvrtc.CompiledModule, str, str]:
    """One NVRTC compilation per template set (head tiles, bf16 query, log2 block size, soft cap,
    split, read ahead, warps), arch and macro set: (module, decode kernel name, merge kernel name)."""
    args = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in template)
    decode = f"paged_decode_fp8<{args}>"
    merge = f"merge_splits<{str(template[1]).lower()}>"
    module = _nvrtc.compile_module_cached(_SOURCE.read_text(), [decode, merge], arch, filename=_SOURCE.name,
                                          defines=defines)
    return module, decode, merge


_LOADED = _nvrtc.LoadedKernels()


def _kernels(device: torch.device, *template: bool | int) -> tuple[_nvrtc.Kernel, ...]:
    """The decode and merge kernels for ``template`` loaded on ``device`` (cached per device)."""
    def build():
        module, decode, merge = _compiled(_capability(device), _DEFINES, *template)
        head_tiles, warps = template[0], template[6]
        return module, [_nvrtc.KernelSpec(decode, _DECODE_SIGNATURE, warps * 32,
                                          shared_bytes=warps * head_tiles * 8 * HEAD_DIM * 4),
                        _nvrtc.KernelSpec(merge, _MERGE_SIGNATURE, 2 * HEAD_DIM)]

    return _LOADED.get(device, (_DEFINES, template), build)


def _warps(plan: DecodePlan, ctas: int, sms: int, max_seq_len: int, head_tiles: int, q_bf16: bool,
           shift: int, soft_cap: bool) -> int:
    """Warps per CTA for ``plan``, a grid of ``ctas`` unsplit CTAs and a template: the plan's,
    at most what the template's registers allow (two head tiles: 4; blocks under 16 positions or
    a soft cap, whose kernels need more than 128 registers a thread: 8); by default 16 (one CTA
    per SM) where the template allows it and wide_split_count takes the grid, else 4 (Llama-3-8B,
    512 CTAs: 94.7% against 91.3% with 16 warps)."""
    most = 4 if head_tiles > 1 else 8 if shift < 4 or soft_cap else 16
    if plan.warps is not None:
        return min(plan.warps, most)
    wide = most == 16 and not plan.read_ahead and wide_split_count(ctas, sms, max_seq_len) is not None
    return 16 if wide else 4


class _Launches(NamedTuple):
    """How a call's kernels launch on sm_90+ (programmatic dependent launch). ``overlap``: both
    kernels launch as programmatic dependents of the kernel before them, and the decode grid
    warms L2 before it waits for that kernel; ``decode_early`` / ``merge_early``: that grid lets
    the kernel after it launch at its start."""
    overlap: bool
    decode_early: bool
    merge_early: bool


def _launches(plan: DecodePlan, capability: tuple[int, int], warps: int, splits: int, ctas: int,
              sms: int, merge_ctas: int) -> _Launches:
    """Overlap by default where the GPU has it (sm_90+). Early triggers only where the next
    kernel's CTAs find SMs that would otherwise idle, as measured on the H100 with 16-warp CTAs
    (perf/notes/attention.md rounds 14 and 16): an unsplit one-wave grid (B 64 x 4096 77.5
    against 75-76%); a merge grid of at most one CTA per SM (B 8 x 32768, 64 merge CTAs: 81.5-82.9
    -> 84.1-84.3%; B 16 x 16384: 78.5-80.4 -> 80.8-81.5). Elsewhere early dependents took SMs
    from a later wave or the merge (B 48 x 4096, 2 splits and 384 merge CTAs: 72.8-74.5 -> 69.5-
    70.8%; B 8 x 32768 with the decode grid triggering at its start: 72.7 against 75-76%). A split
    grid's CTAs let the merge launch as their streams end, in the kernel itself."""
    overlap = plan.overlap if plan.overlap is not None else capability >= PDL_CAPABILITY
    wide = overlap and warps == 16
    return _Launches(overlap, wide and splits == 1 and ctas < sms, wide and splits > 1 and merge_ctas <= sms)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's paged_attention: prefill batches on prefill.py's kernel; fp8 decode on one
    kernel, plus a merge when it splits. Arguments are validated by the caller and accepted by
    paged_attention_supports."""
    if max_query_len > 1:
        return prefill.paged_prefill(query, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, max_query_len,
                                     scale, causal, sliding_window, logits_soft_cap, sinks)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_q_heads, _ = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0 or max_query_len == 0:
        return out.zero_()
    group = num_q_heads // num_kv_heads
    device = query.device
    plan = _plans.current
    template = (-(-group // 8), query.dtype == torch.bfloat16, page_shift(k_cache.shape[1]),
                logits_soft_cap > 0)
    ctas, sms = num_kv_heads * num_seqs, _sm_count(device)
    warps = _warps(plan, ctas, sms, max_seq_len, *template)
    with torch.cuda.device(device):
        splits = plan.num_splits
        if splits is None and warps == 16:
            splits = wide_split_count(ctas, sms, max_seq_len) or 1  # None: a plan's 16 warps on a full grid
        elif splits is None:
            unsplit, _ = _kernels(device, *template, False, plan.read_ahead, warps)
            splits = split_count(ctas, unsplit.blocks_per_sm * sms, max_seq_len)
        decode, merge = _kernels(device, *template, splits > 1, plan.read_ahead, warps)
        launches = _launches(plan, _capability(device), warps, splits, ctas, sms, num_tokens * num_q_heads)
        if splits > 1:
            part_acc = torch.empty((splits, num_tokens, num_q_heads, HEAD_DIM), dtype=torch.float32,
                                   device=device)
            part_ml = torch.empty((2, splits, num_tokens, num_q_heads), dtype=torch.float32, device=device)
        else:
            part_acc = part_ml = None
        decode(
            (num_kv_heads, num_seqs, splits),
            query, k_cache, v_cache, out, part_acc, part_ml, cu_seqlens_q, block_table, seq_lens,
            sinks, k_scale, v_scale,
            num_tokens, num_q_heads, group, splits, int(sliding_window), int(launches.decode_early),
            int(launches.overlap), block_table.shape[1], k_cache.shape[0],
            float(scale), float(logits_soft_cap),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0),
            overlap_previous=launches.overlap,
        )
        if splits > 1:
            merge((num_tokens, num_q_heads, 1), out, part_acc, part_ml, sinks, num_tokens, num_q_heads,
                  splits, int(launches.merge_early), out.stride(0), out.stride(1),
                  overlap_previous=launches.overlap)
    return out
