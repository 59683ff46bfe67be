"""Host side of the cuda backend's fp8 e4m3 paged-attention decode (kernels/paged_decode_fp8.cu):
what it takes, its launch plan from host ints (warps, KV splits, programmatic dependent launch),
and its launch, plus the split-KV merge when it splits."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _compile, _driver, _merge, _params
from kernelmux.backends.cuda._layout import page_shift
from kernelmux.backends.cuda._targets import DECODE_MIN_CAPABILITY, PDL_CAPABILITY
from kernelmux.platforms import probes

__all__ = ["DEFAULT_PLAN", "DecodePlan", "HEAD_DIM", "LaunchPlan", "MAX_GROUP", "MIN_SPLIT_LEN", "launch_plan",
           "override_plan", "paged_decode", "shape_reason", "source", "split_count", "wide_split_count"]

FP8 = torch.float8_e4m3fn
HEAD_DIM = 128  # the kernel's lane-to-dim maps are written for 128 dims
MAX_GROUP = 16  # query heads per KV head: two 8-column MMA tiles
MIN_CAPABILITY = DECODE_MIN_CAPABILITY
# Splits: each share at least this many positions (two 32-position steps per warp of a 4-warp
# CTA: shorter shares spend more on partials and the merge than they gain), at most _MAX_SPLITS.
MIN_SPLIT_LEN = 256
_MAX_SPLITS = _merge.MAX_SPLITS
# Two groups of 128 threads share a merge's splits: 64-split merge 9.5 -> 2.9 us with the maxima
# read at once and two groups (perf/decisions/paged_attention.md).
MERGE_GROUPS = 2
# 16-warp CTAs (one per SM): a grid holding at least WIDE_UNSPLIT_FILL of the SMs does not split,
# and each CTA takes at least WIDE_MIN_SHARE positions (four 32-position steps a warp).
WIDE_UNSPLIT_FILL = 0.45
WIDE_MIN_SHARE = 2048
SOURCE_NAME = "paged_decode_fp8.cu"


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
    else as many splits as fill one wave: the H100 fp8 sweep's best at each measured batch
    (perf/decisions/paged_attention.md)."""
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
        return "decode only (max_query_len <= 1): prefill is _paged_prefill.py's kernel"
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


def _warps(plan: DecodePlan, ctas: int, sms: int, max_seq_len: int, head_tiles: int, q_bf16: bool,
           shift: int, soft_cap: bool) -> int:
    """Warps per CTA for ``plan``, a grid of ``ctas`` unsplit CTAs and a template: the plan's,
    at most what the template's registers allow (two head tiles: 4; blocks under 16 positions or
    a soft cap, whose kernels need more than 128 registers a thread: 8); by default 16 (one CTA
    per SM) where the template allows it and wide_split_count takes the grid, else 4 (faster at
    Llama-3-8B's 512 CTAs: perf/decisions/paged_attention.md)."""
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
    kernel's CTAs find SMs that would otherwise idle (16-warp CTAs): an unsplit one-wave grid, and
    a merge grid of at most one CTA per SM; elsewhere early dependents took SMs from a later wave
    or the merge (H100 measurements: perf/decisions/paged_attention.md). A split grid's CTAs let
    the merge launch as their streams end, in the kernel itself."""
    overlap = plan.overlap if plan.overlap is not None else capability >= PDL_CAPABILITY
    wide = overlap and warps == 16
    return _Launches(overlap, wide and splits == 1 and ctas < sms, wide and splits > 1 and merge_ctas <= sms)


_capability = probes.device_capability
_sm_count = probes.compute_units


def kernel_names(*template: bool | int) -> tuple[str, str]:
    """The C++ names of the decode and merge kernels of a template set (head tiles, bf16 query,
    log2 block size, soft cap, split, read ahead, warps)."""
    args = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in template)
    return f"paged_decode_fp8<{args}>", _merge.kernel_name(HEAD_DIM, MERGE_GROUPS, bool(template[1]))


def source(names: tuple[str, ...]) -> str:
    """kernels/paged_decode_fp8.cu with the named ABI's checks for the decode and merge kernels
    among ``names``."""
    return _params.checked_source(SOURCE_NAME, [
        (_params.PagedDecodeParams, [n for n in names if n.startswith("paged_decode_fp8<")]),
        (_params.MergeSplitsParams, [n for n in names if n.startswith("merge_splits<")])])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...],
              *template: bool | int) -> tuple[_compile.CompiledModule, str, str]:
    """One NVRTC compilation per template set, arch and macro set: (module, decode kernel name,
    merge kernel name)."""
    decode, merge = kernel_names(*template)
    module = _compile.compile_module_cached(source((decode, merge)), [decode, merge], arch, filename=SOURCE_NAME,
                                            defines=defines)
    return module, decode, merge


_LOADED = _driver.LoadedKernels()


def _kernels(device: torch.device, *template: bool | int) -> tuple[_driver.Kernel, ...]:
    """The decode and merge kernels for ``template`` loaded on ``device`` (cached per device and
    diagnostic macros)."""
    defines = _compile.diagnostics_in_force()

    def build():
        module, decode, merge = _compiled(_capability(device), defines, *template)
        head_tiles, warps = template[0], template[6]
        return module, [_driver.KernelSpec(decode, _params.PagedDecodeParams, warps * 32,
                                           shared_bytes=warps * head_tiles * 8 * HEAD_DIM * 4),
                        _merge.kernel_spec(merge, MERGE_GROUPS)]

    return _LOADED.get(device, (defines, template), build)


@dataclass(frozen=True)
class LaunchPlan:
    """One call's launch, from host ints only: the kernels' template set, KV splits, and the
    programmatic-dependent-launch choices (_Launches)."""

    template: tuple
    splits: int
    launches: _Launches


@functools.lru_cache(maxsize=4096)
def launch_plan(device: torch.device, plan: DecodePlan, defines: tuple[str, ...], num_seqs: int,
                num_kv_heads: int, num_tokens: int, num_q_heads: int, q_bf16: bool, block_size: int,
                soft_cap: bool, max_seq_len: int) -> LaunchPlan:
    """The LaunchPlan of a call with these host ints on ``device`` under ``plan`` (cached: the
    occupancy it may ask is the loaded kernel's, under the diagnostic macros ``defines``)."""
    group = num_q_heads // num_kv_heads
    template = (-(-group // 8), q_bf16, page_shift(block_size), soft_cap)
    ctas, sms = num_kv_heads * num_seqs, _sm_count(device)
    warps = _warps(plan, ctas, sms, max_seq_len, *template)
    splits = plan.num_splits
    if splits is None and warps == 16:
        splits = wide_split_count(ctas, sms, max_seq_len) or 1  # None: a plan's 16 warps on a full grid
    elif splits is None:
        with torch.cuda.device(device):
            unsplit, _ = _kernels(device, *template, False, plan.read_ahead, warps)
        splits = split_count(ctas, unsplit.blocks_per_sm * sms, max_seq_len)
    launches = _launches(plan, _capability(device), warps, splits, ctas, sms, num_tokens * num_q_heads)
    return LaunchPlan((*template, splits > 1, plan.read_ahead, warps), splits, launches)


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    sinks: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> torch.Tensor:
    """The spec's paged_attention for a decode batch (``max_query_len <= 1``) on one kernel,
    plus a merge when it splits; arguments are validated by the caller and accepted by
    shape_reason and paged_attention.supports."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_q_heads, _ = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0:
        return out.zero_()
    device = query.device
    plan = launch_plan(device, _plans.current, _compile.diagnostics_in_force(), num_seqs, num_kv_heads, num_tokens,
                       num_q_heads, query.dtype == torch.bfloat16, k_cache.shape[1], logits_soft_cap > 0, max_seq_len)
    splits, launches = plan.splits, plan.launches
    with torch.cuda.device(device):
        decode, merge = _kernels(device, *plan.template)
        if splits > 1:
            part_acc, part_ml = _merge.partials(splits, num_tokens, num_q_heads, HEAD_DIM, device)
        else:
            part_acc = part_ml = None
        decode(
            (num_kv_heads, num_seqs, splits), overlap_previous=launches.overlap,
            query=query, k_cache=k_cache, v_cache=v_cache, out=out, part_acc=part_acc, part_ml=part_ml,
            cu_seqlens_q=cu_seqlens_q, block_table=block_table, seq_lens=seq_lens, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale, num_tokens=num_tokens, num_q_heads=num_q_heads, group=num_q_heads // num_kv_heads,
            num_splits=splits, window=int(sliding_window), launch_next_early=int(launches.decode_early),
            warm_start=int(launches.overlap), table_width=block_table.shape[1], num_cache_blocks=k_cache.shape[0],
            scale=float(scale), soft_cap=float(logits_soft_cap),
            q_stride_t=query.stride(0), q_stride_h=query.stride(1), o_stride_t=out.stride(0),
            o_stride_h=out.stride(1), k_stride_b=k_cache.stride(0), k_stride_s=k_cache.stride(1),
            k_stride_h=k_cache.stride(2), v_stride_b=v_cache.stride(0), v_stride_s=v_cache.stride(1),
            v_stride_h=v_cache.stride(2), table_stride=block_table.stride(0),
        )
        if splits > 1:
            _merge.launch(merge, out, part_acc, part_ml, overlap_previous=launches.overlap, sinks=sinks,
                          launch_next_early=launches.merge_early)
    return out
