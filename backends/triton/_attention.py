"""The launch plans (tile shape, warps, pipeline depth, KV splits) and the launches that the triton
backend's paged_attention and mla_decode share: both run the kernel of _attention_kernel.py, from
a table of measured plans chosen with host ints alone."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import INTERPRETED, compute_units, device_guard, next_pow2
from kernelmux.platforms import Platform, PlatformKind, probes

__all__ = ["FP8", "AttentionPlan", "kind_for", "launch", "launch_limit", "override_plan", "plan_for"]

FP8 = torch.float8_e4m3fn


def _dot_width(n: int) -> int:
    # A reduction dim of tl.dot must be a power of two >= 16 on the GPU (the interpreter takes
    # any): narrower head or rope dims are zero-padded by masked loads.
    return max(next_pow2(n), 16)


@dataclass(frozen=True)
class AttentionPlan:
    """One launch: ``block_m`` rows (tokens x query heads of one KV head) per program,
    ``block_n`` KV positions per step, ``num_splits`` shares of each tile's KV range (merged by a
    second kernel when > 1), and Triton's ``num_warps`` and ``num_stages``. ``prefetch_pages``
    loads each step's block-table entries one step ahead, so that ``num_stages - 1`` KV tiles are
    in flight rather than ``num_stages - 2`` (Triton's pipeliner otherwise spends a stage on the
    table load), at the cost of the registers holding the next step's entries.
    ``programs_per_sm`` is how many of the plan's programs an SM holds at once on its table's
    GPUs, from the registers and shared memory Triton 3.6 compiles it to (a CPU test fails a plan
    that claims more than the installed Triton's compile fits): the split heuristic's wave."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    prefetch_pages: bool = False
    programs_per_sm: int = 1


def _fields_problem(fields: Optional[dict]) -> Optional[str]:
    unknown = set(fields or ()) - set(AttentionPlan.__dataclass_fields__)
    return f"unknown AttentionPlan fields {sorted(unknown)}" if unknown else None


# Fields replaced in every plan the table gives (None: none).
_override: ScopedSetting[Optional[dict]] = ScopedSetting("override_plan", None, _fields_problem)


def override_plan(**fields) -> contextlib.AbstractContextManager[Optional[dict]]:
    """Replace fields of every plan inside the block (sweeps and tests), e.g.
    ``override_plan(num_splits=4)`` or ``override_plan(block_n=32, num_stages=3)``."""
    return _override.override(fields)


_sm_count = compute_units  # (a module name of its own: tests pin it)


# Base plans by kind of call, chosen on an H100 by perf/diag/attention_sweep.py. "decode": one
# query per sequence, a KV head's query heads packed as rows; "prefill_large" is plan_for's pick
# for long prefills only. The block-table prefetch cost the decode and MLA plans 1-10% (more
# registers), so only "prefill_large" takes it.
_TABLE = {  # sm_90: 64K registers and 228 KB of shared memory per SM
    # 16 x 128 x 4 warps: 99.8% of copy on Llama-3-8B B64 x 4096 (88% with 64 positions; 8 warps
    # lost: the tile is 16 rows), perf/decisions/paged_attention.md
    "decode": AttentionPlan(block_m=16, block_n=128, num_warps=4, num_stages=2, programs_per_sm=2),
    # fp8 cache: one more stage, 81.8% of copy against 78.1% with 2, perf/decisions/paged_attention.md
    "decode_fp8": AttentionPlan(block_m=16, block_n=128, num_warps=4, num_stages=3, programs_per_sm=2),
    # 64 x 64 x 4 x 3: 46% of the bf16 matmul rate on Llama-3-8B at 8192 tokens, the best of eight
    # plans, perf/decisions/paged_attention.md
    "prefill": AttentionPlan(block_m=64, block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
    # 128 x 128 x 8 x 3, table prefetched: 49.0% there but 9-24% slower than "prefill" on short and
    # chunked prefills; 225 KB of shared memory at head dim 128, perf/decisions/paged_attention.md
    "prefill_large": AttentionPlan(block_m=128, block_n=128, num_warps=8, num_stages=3, prefetch_pages=True),
    # 64 heads x 64 positions x 8 warps: 32% of copy with a bf16 cache, the best of ten (128 heads
    # ran out of shared memory), perf/decisions/mla_decode.md
    "mla": AttentionPlan(block_m=64, block_n=64, num_warps=8, num_stages=2),
    # 128 positions in one stage: 393 us against 467 us for the bf16 plan, perf/decisions/mla_decode.md
    "mla_fp8": AttentionPlan(block_m=64, block_n=128, num_warps=8, num_stages=1),
}
# _TABLE's prefill and MLA plans take 216-225 KB of shared memory: Hopper and datacenter
# Blackwell (sm_90, sm_100/103) allow 227 KB per program. Other GPUs (A100: 163 KB; sm_86, sm_89
# and sm_120: 99 KB), ROCm and Intel GPUs get plans that fit 99 KB: 40-72 KB compiled for sm_80
# and sm_89, not timed on such a GPU, perf/decisions/paged_attention.md. A plan that still does
# not fit steps down (launch).
_COMPACT_TABLE = {  # programs per SM for the tightest of these GPUs: 100 KB of shared memory per SM
    "decode": replace(_TABLE["decode"], programs_per_sm=1),  # 72 KB
    "decode_fp8": _TABLE["decode_fp8"],  # 41 KB
    "prefill": AttentionPlan(block_m=64, block_n=64, num_warps=4, num_stages=2),  # 56 KB
    "prefill_large": AttentionPlan(block_m=64, block_n=64, num_warps=4, num_stages=2),
    "mla": AttentionPlan(block_m=32, block_n=16, num_warps=4, num_stages=2),  # 55 KB
    "mla_fp8": AttentionPlan(block_m=32, block_n=32, num_warps=4, num_stages=2),  # 70 KB
}
_LARGE_SHARED_MEMORY_MAJORS = (9, 10)

# KV splits fill the GPU when the grid is short of one wave (the plan's programs_per_sm on every
# SM). plan_for takes the split count that finishes in the fewest waves' time and, of equals,
# the fewest splits: DeepSeek-V3 MLA B64 x 4096 (128 programs, 132 SMs) ran in 271 us unsplit,
# 325 us in two waves of two splits, perf/decisions/mla_decode.md. Split counts are powers of
# two, so shares divide power-of-two lengths evenly: 4 splits 58% of copy, 5 splits 51%, on
# Llama-3-70B TP8 fp8 B64 x 4096, perf/decisions/paged_attention.md. Shares are never shorter than
# _MIN_SPLIT_LEN positions (the merge then costs more than the parallelism gains).
_MIN_SPLIT_LEN = 512
_MAX_SPLITS = 64
# "prefill_large" needs this many waves of its programs: it won at 15.6 (Llama-3-8B, 8192 tokens)
# and lost at 0.2-2.2 (short, chunked and sinks prefills); 4 sits between, unmeasured,
# perf/decisions/paged_attention.md. Past head dim 128 it does not fit shared memory.
_LARGE_PREFILL_MIN_WAVES = 4
_LARGE_PREFILL_MAX_HEAD_DIM = 128


def plan_for(
    kind: str, device: torch.device, num_seqs: int, num_tokens: int, group: int, num_kv_heads: int,
    max_query_len: int, max_seq_len: int, *, head_dim: int,
) -> AttentionPlan:
    """The plan for a call, from host ints only: decode versus prefill comes from ``max_query_len``
    and the token count, the split count from the batch size, head counts, ``max_seq_len`` and the
    SM count. A call never syncs with the host, and a captured CUDA graph stays valid when the
    lengths, block tables and queries change under it (``max_seq_len`` at capture bounds them).
    ``kind`` is kind_for's; a prefill with a grid of several waves of large tiles gets
    "prefill_large"."""
    if kind == "prefill" and head_dim <= _LARGE_PREFILL_MAX_HEAD_DIM:
        large = _base_plan("prefill_large", device)
        tiles, head_tiles = _grid_size(large.block_m, group, num_seqs, num_tokens, max_query_len)
        waves = tiles * head_tiles * num_kv_heads / (large.programs_per_sm * _sm_count(device))
        if waves >= _LARGE_PREFILL_MIN_WAVES:
            kind = "prefill_large"
    plan = _base_plan(kind, device)
    if "num_splits" in (_override.current or ()):
        return plan
    tiles, head_tiles = _grid_size(plan.block_m, group, num_seqs, num_tokens, max_query_len)
    programs = max(tiles * head_tiles * num_kv_heads, 1)
    slots = plan.programs_per_sm * _sm_count(device)
    most = min(max_seq_len // _MIN_SPLIT_LEN, _MAX_SPLITS)
    if programs >= slots or most < 2:
        return replace(plan, num_splits=1)
    # A grid short of one wave: each candidate's time in waves of whole-range programs is
    # ceil(programs * s / slots) waves of programs 1/s as long; of the fastest, the fewest splits
    # (each adds partials to write and merge).
    candidates = [1 << i for i in range(most.bit_length())]
    splits = min(candidates, key=lambda s: (-(-programs * s // slots) / s, s))
    return replace(plan, num_splits=splits)


def _base_plan(kind: str, device: torch.device) -> AttentionPlan:
    """The device's table's plan for ``kind`` with the active override applied (splits not yet
    chosen)."""
    plan = _table_for(device)[kind]
    fields = _override.current
    return plan if fields is None else replace(plan, **fields)


def _table_for(device: torch.device) -> dict:
    """The plan table for launches on ``device``."""
    if device.type == "cpu":
        return _TABLE  # the interpreter's
    nvidia = device.type == "cuda" and not probes.is_rocm()
    return _table_for_gpu(nvidia, _capability(device) if nvidia else None)  # torch.cuda knows no XPU


def _table_for_platform(platform: Platform) -> dict:
    """The plan table the launches on ``platform``'s GPU use (supports decides on it)."""
    if platform.kind is PlatformKind.CPU:
        return _TABLE
    return _table_for_gpu(platform.kind is PlatformKind.CUDA, platform.capability)


def _table_for_gpu(nvidia: bool, capability: Optional[tuple[int, int]]) -> dict:
    # Intel's shared local memory is 64-128 KB; ROCm reports gfx9 parts as major 9, but their LDS
    # is 64-160 KB.
    if not nvidia or capability is None or capability[0] not in _LARGE_SHARED_MEMORY_MAJORS:
        return _COMPACT_TABLE
    return _TABLE


_capability = probes.device_capability


def kind_for(max_query_len: int, cache_dtype: torch.dtype, mla: bool) -> str:
    """The _TABLE row for a call."""
    if mla:
        return "mla_fp8" if cache_dtype == FP8 else "mla"
    if max_query_len > 1:
        return "prefill"
    return "decode_fp8" if cache_dtype == FP8 else "decode"


# CUDA caps grid axes 1 and 2 at 65535 programs; query tiles run along axis 1.
_MAX_GRID_Y = 65535


def launch_limit(kind: str, platform: Platform, cache_dtype: torch.dtype, group: int, num_seqs: int,
                  num_tokens: int, one_query_per_seq: bool) -> Optional[str]:
    """Why a call would not compile or launch on ``platform``, or None. ``num_seqs`` and
    ``num_tokens`` are upper bounds (the key's size classes): a bound past a limit declines,
    never a call that fits."""
    capability = platform.capability
    if (cache_dtype == FP8 and platform.kind is PlatformKind.CUDA and capability is not None
            and capability < (8, 9)):
        return f"fp8 e4m3 caches need sm_89 or newer in Triton; this GPU is {platform.arch}"
    block_m = _table_for_platform(platform)[kind].block_m
    tiles = num_seqs if one_query_per_seq else num_tokens // (block_m // min(group, block_m)) + num_seqs
    if tiles > _MAX_GRID_Y:
        return (f"up to {tiles} query tiles (this batch's size class) > {_MAX_GRID_Y}, CUDA's limit on grid "
                "axis 1 (split the batch)")
    return None


def _grid_size(block_m: int, group: int, num_seqs: int, num_tokens: int, max_query_len: int):
    """(query tiles, head tiles per KV head) of the kernel's grid. One query per sequence: tile b
    is sequence b. Otherwise a bound the kernel's tile-to-sequence search relies on: sequence b's
    ceil(q_len_b / tokens_per_tile) tiles start at cu_q[b] // tokens_per_tile + b."""
    heads_per_tile = min(group, block_m)
    tokens_per_tile = block_m // heads_per_tile
    if _one_query_per_seq(num_seqs, num_tokens, max_query_len):
        tiles = num_seqs
    else:
        tiles = num_tokens // tokens_per_tile + num_seqs
    return tiles, -(-group // heads_per_tile)


def _one_query_per_seq(num_seqs: int, num_tokens: int, max_query_len: int) -> bool:
    # No q_len exceeds max_query_len <= 1, so T == B means every sequence has exactly one.
    return max_query_len <= 1 and num_tokens == num_seqs


# Plans a GPU could not run (Triton's OutOfResources when a compiled kernel is first loaded:
# too much shared memory, e.g. head dim 256 on a GPU with 99 KB), by what shapes their shared
# memory, and the smaller plan that ran instead.
_FITTED: dict = {}


def _smaller(plan: AttentionPlan) -> Optional[AttentionPlan]:
    """The next plan to try when ``plan`` does not fit: shorter KV steps first (down to 32),
    then fewer stages, then steps of 16, then fewer rows; None when nothing is left."""
    if plan.block_n > 32:
        return replace(plan, block_n=plan.block_n // 2)
    if plan.num_stages > 1:
        return replace(plan, num_stages=plan.num_stages - 1)
    if plan.block_n > 16:
        return replace(plan, block_n=16)
    if plan.block_m > 16:
        return replace(plan, block_m=plan.block_m // 2)
    return None


def launch(*, plan: AttentionPlan, **args) -> None:
    """_launch with ``plan``, or with the first _smaller plan the GPU has the resources for
    (remembered, so the search runs once per process).

    The first call with a new constexpr set (dtypes, head geometry, cache block size, options,
    plan, split or not; not the batch size, lengths or split count) costs one Triton compilation,
    plus one of the merge kernel when it splits: 0.6-2.8 s each for sm_90 on a 2-core VM
    (perf/diag/attention_compile_cost.py), then Triton's on-disk cache serves later processes. A
    plan the GPU cannot hold costs one compilation per smaller plan tried. Nothing else is done on
    a first call: no autotuning, no benchmark. Triton itself is imported here, so the backend
    registers (and reports "missing package triton") on machines without it."""
    from triton.runtime.errors import OutOfResources

    q, k = args["q"], args["k"]
    key = (q.device, q.dtype, k.dtype, k.shape[1], args["d_main"], args["d_rope"], args["v_from_k"], plan)
    fitted = _FITTED.get(key, plan)
    while True:
        try:
            _launch(plan=fitted, **args)
        except OutOfResources:
            fitted = _smaller(fitted)
            if fitted is None:
                raise
            continue
        _FITTED[key] = fitted
        return


def _launch(
    *, q, k, v, out, lse, cu_seqlens_q, block_table, seq_lens, sinks, k_scale, v_scale,
    max_query_len, scale, causal, window, soft_cap, group, d_main, d_rope, v_from_k, plan,
):
    from kernelmux.backends.triton import _attention_kernel as kernels

    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    num_seqs = seq_lens.shape[0]
    num_kv_heads = num_q_heads // group
    heads_per_tile = min(group, plan.block_m)
    tiles, head_tiles = _grid_size(plan.block_m, group, num_seqs, num_tokens, max_query_len)
    splits = plan.num_splits
    device = q.device
    if splits > 1:
        part_acc = torch.empty((splits, num_tokens, num_q_heads, d_main), dtype=torch.float32, device=device)
        part_ml = torch.empty((2, splits, num_tokens, num_q_heads), dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = out
    want_lse = lse is not None
    grid = (num_kv_heads * head_tiles, tiles, splits)
    with device_guard(device):
        kernels.paged_attention_kernel[grid](
            q, k, v, out, lse if want_lse else out, part_acc, part_ml,
            cu_seqlens_q, block_table, seq_lens,
            sinks if sinks is not None else out,
            k_scale if k_scale is not None else out,
            v_scale if v_scale is not None else out,
            num_seqs, num_tokens, splits, float(scale), float(soft_cap), int(window),
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2) if k.dim() == 4 else 0,
            v.stride(0), v.stride(1), v.stride(2) if v.dim() == 4 else 0,
            out.stride(0), out.stride(1),
            block_table.stride(0), block_table.stride(1),
            cu_seqlens_q.stride(0), seq_lens.stride(0), sinks.stride(0) if sinks is not None else 0,
            NUM_Q_HEADS=num_q_heads,
            GROUP=group,
            HEADS_PER_TILE=heads_per_tile,
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            D_MAIN=d_main,
            D_ROPE=d_rope,
            BLOCK_D=_dot_width(d_main),
            BLOCK_R=_dot_width(d_rope) if d_rope else 1,
            BLOCK_SIZE=k.shape[1],
            ONE_QUERY_PER_SEQ=_one_query_per_seq(num_seqs, num_tokens, max_query_len),
            CAUSAL=causal,
            WINDOW=window > 0,
            SOFT_CAP=soft_cap > 0,
            HAS_SINKS=sinks is not None,
            HAS_K_SCALE=k_scale is not None,
            HAS_V_SCALE=v_scale is not None,
            V_FROM_K=v_from_k,
            RETURN_LSE=want_lse,
            SPLIT_KV=splits > 1,
            DOT_FP32=INTERPRETED,  # the interpreter's fp16 dots are right: DOT_FP16 runs there too
            # fp8 cache, bf16 queries: both dots in fp16, one conversion instruction per two cache
            # elements instead of several (queries past fp16's range are scaled by a power of two).
            DOT_FP16=k.dtype == FP8 and q.dtype == torch.bfloat16,
            PREFETCH_PAGES=plan.prefetch_pages,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
        if splits > 1:
            kernels.merge_splits_kernel[(num_tokens, num_q_heads)](
                out, lse if want_lse else out, part_acc, part_ml,
                sinks if sinks is not None else out,
                num_tokens, splits, out.stride(0), out.stride(1), sinks.stride(0) if sinks is not None else 0,
                NUM_Q_HEADS=num_q_heads,
                D_MAIN=d_main,
                BLOCK_D=_dot_width(d_main),
                SPLITS_PAD=next_pow2(splits),
                HAS_SINKS=sinks is not None,
                RETURN_LSE=want_lse,
                num_warps=4 if d_main >= 256 else 2,
            )
