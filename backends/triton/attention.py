"""Host side of the triton backend's paged_attention and mla_decode: what the kernels support,
the launch plan (tile shape, warps, pipeline depth, KV splits) chosen from host ints alone, and
the launches (kernels: _attention_kernel.py).

The plan never reads device data: decode versus prefill comes from ``max_query_len`` and the
token count, the split count from the batch size, head counts, ``max_seq_len`` and the SM count.
A call therefore never syncs with the host, and a captured CUDA graph stays valid when the
sequence lengths, block tables and queries change under it (``max_seq_len`` at capture bounds
them). Configurations come from a table of measured choices (see ``_TABLE``), not from
autotuning. The first call with a new constexpr set (dtypes, head geometry, cache block size,
options, decode/prefill/MLA plan, split or not; not the batch size, lengths or split count)
costs one Triton compilation, plus one of the merge kernel when it splits: 0.6-2.8 s each for
sm_90 with Triton 3.6 on a 2-core VM (perf/diag/attention_compile_cost.py; record in
perf/results/attention_compile_cost_*), then Triton's on-disk cache serves later processes. A
plan the GPU cannot hold costs one more compilation per smaller plan tried, once per process
(_launch_fitting). Nothing else is done on a first call: no autotuning, no benchmark.

Triton itself is imported on the first launch, so the backend registers (and reports "missing
package triton") on machines without it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import INTERPRETED, next_pow2
from kernelmux.platforms import Platform, PlatformKind, probes
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as paged_spec

__all__ = [
    "AttentionPlan",
    "mla_decode",
    "mla_decode_supports",
    "override_plan",
    "paged_attention",
    "paged_attention_supports",
    "plan_for",
]

FP8 = torch.float8_e4m3fn
# Register tiles: a [BLOCK_M, next_pow2(D)] fp32 accumulator, the query tile and two KV tiles.
# Past these widths the tiles spill; no model in the specs' cases comes near.
MAX_HEAD_DIM = 256
MAX_MLA_WIDTH = 1024

def _dot_width(n: int) -> int:
    # A reduction dim of tl.dot must be a power of two >= 16 on the GPU (the interpreter takes
    # any): narrower head or rope dims are zero-padded by masked loads.
    return max(next_pow2(n), 16)


@dataclass(frozen=True)
class AttentionPlan:
    """One launch: ``block_m`` rows (tokens x query heads of one KV head) per program,
    ``block_n`` KV positions per step, ``num_splits`` shares of each tile's KV range (merged by a
    second kernel when > 1), and Triton's ``num_warps`` and ``num_stages``. With an fp8 cache and
    bf16 queries, ``fp16_dots_for_fp8`` runs both dots in fp16: one conversion instruction per two
    cache elements instead of several (a tile of queries reaching past fp16's range is scaled by
    a power of two, exactly, with the softmax scale compensating). ``prefetch_pages`` loads each
    step's block-table entries one step ahead, so that ``num_stages - 1`` KV tiles are in flight
    rather than ``num_stages - 2`` (Triton's pipeliner otherwise spends a stage on the table
    load), at the cost of the registers holding the next step's entries. ``programs_per_sm`` is
    how many of the plan's programs an SM holds at once on its table's GPUs, from the registers
    and shared memory Triton 3.6 compiles it to (a CPU test fails a plan that claims more than
    the installed Triton's compile fits): the split heuristic's wave."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    fp16_dots_for_fp8: bool = True  # fp8 cache, bf16 queries: dots in fp16 (cheaper conversion)
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


def _sm_count(device: torch.device) -> int:
    """Units a program runs on (probes.compute_units); 4 under the interpreter, so that a few
    splits still exercise the merge."""
    return probes.compute_units(device) if device.type in ("cuda", "xpu") else 4


# Base configurations, by kind of call, chosen on an H100 by perf/diag/attention_sweep.py
# (records: perf/results/attention_sweep_h100_*.json; summary in perf/README.md). "decode": one
# query per sequence, the query heads of a KV head packed as rows. 128 positions per step won
# for bf16 caches (99.8% of copy bandwidth on Llama-3-8B B64 x 4096 against 88% with 64; 8 warps
# lost everywhere: the tile is 16 rows). "decode_fp8": the same tile with one more pipeline
# stage (81.8% against 78.1% with 2; fp16 dots, see AttentionPlan). "prefill": 64 rows (16
# tokens x 4 heads) by 64 positions, 4 warps, 3 stages: 46% of the bf16 matmul rate on Llama-3-8B
# at 8192 tokens, the best of eight in round 2. "prefill_large" (round 4, 61deb5e): 128 rows by
# 128 positions, 8 warps, 3 stages with the block table prefetched: 49.0% there (51.1% in the
# bench at cad439b), but 9-24% slower than "prefill" on 1024-token and chunked prefills (one
# program per SM, fewer of them), so plan_for takes it only for grids of several waves and head
# dims up to 128 (it takes 225 KB of shared memory at 128; Hopper's limit is 227 KB). The decode
# and MLA plans lost 1-10% with the prefetch (more registers), so they go without. "mla": 64
# heads by 64 positions, 8 warps: 32% of bandwidth with a bf16 cache, the best of ten (128 heads
# ran out of shared memory); "mla_fp8": 128 positions in one stage, 393 us against 467 us for
# the bf16 plan.
_TABLE = {  # sm_90: 64K registers and 228 KB of shared memory per SM
    "decode": AttentionPlan(block_m=16, block_n=128, num_warps=4, num_stages=2, programs_per_sm=2),
    "decode_fp8": AttentionPlan(block_m=16, block_n=128, num_warps=4, num_stages=3, programs_per_sm=2),
    "prefill": AttentionPlan(block_m=64, block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
    "prefill_large": AttentionPlan(block_m=128, block_n=128, num_warps=8, num_stages=3, prefetch_pages=True),
    "mla": AttentionPlan(block_m=64, block_n=64, num_warps=8, num_stages=2),
    "mla_fp8": AttentionPlan(block_m=64, block_n=128, num_warps=8, num_stages=1),
}
# _TABLE's prefill and MLA plans take 216-225 KB of shared memory: Hopper and datacenter
# Blackwell (sm_90, sm_100/103) allow 227 KB per program. Other GPUs (A100: 163 KB; sm_86, sm_89
# and sm_120: 99 KB) get plans that fit 99 KB (40-72 KB compiled for sm_80 and sm_89 with Triton
# 3.6: perf/results/attention_compile_cost_sm90_triton36_aeee6aa.txt). Not timed on such a GPU:
# none was at hand. ROCm and Intel GPUs get them too. A plan that still does not fit steps down
# (_launch_fitting).
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
# the fewest splits: on DeepSeek-V3 MLA B64 x 4096 (128 programs, 132 SMs) no split ran in 271
# us, two (256 programs, two waves of half-length ones) in 325 (dc24d47). Never shares shorter
# than _MIN_SPLIT_LEN positions (the merge then costs more than the parallelism gains), and a
# power of two, so the shares divide the power-of-two lengths evenly: on Llama-3-70B TP8 B64 x
# 4096 with an fp8 cache, 5 splits (shares of 896, 896, 896, 896, 512) ran at 51% of bandwidth,
# 4 at 58%, 8 at 55%.
_MIN_SPLIT_LEN = 512
_MAX_SPLITS = 64
# "prefill_large" needs at least this many waves of its programs. On an H100 it won at 15.6 waves
# (Llama-3-8B, 8192 tokens) and lost at 0.2-2.2 (the 1024-token, 4-prompt, chunked and gpt-oss
# sinks prefills of the bench at cad439b); 4 sits between, unmeasured.
_LARGE_PREFILL_MIN_WAVES = 4
_LARGE_PREFILL_MAX_HEAD_DIM = 128


def plan_for(
    kind: str, device: torch.device, num_seqs: int, num_tokens: int, group: int, num_kv_heads: int,
    max_query_len: int, max_seq_len: int, *, head_dim: int,
) -> AttentionPlan:
    """The plan for a call, from host ints only (no device data: CUDA-graph safe). ``kind`` is
    _kind's; a prefill with a grid of several waves of large tiles gets "prefill_large"."""
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
    rocm = probes.is_rocm()
    return _table_for_gpu(device.type == "cuda" and not rocm, None if rocm else _capability(device))


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


def _kind(max_query_len: int, cache_dtype: torch.dtype, mla: bool) -> str:
    """The _TABLE row for a call."""
    if mla:
        return "mla_fp8" if cache_dtype == FP8 else "mla"
    if max_query_len > 1:
        return "prefill"
    return "decode_fp8" if cache_dtype == FP8 else "decode"


# CUDA caps grid axes 1 and 2 at 65535 programs; query tiles run along axis 1.
_MAX_GRID_Y = 65535


def _launch_limit(kind: str, platform: Platform, cache_dtype: torch.dtype, group: int, num_seqs: int,
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


def _device_guard(device: torch.device):
    # Triton launches on the current device; switch only when the tensors live elsewhere.
    for kind, module in (("cuda", torch.cuda), ("xpu", torch.xpu)):
        if device.type == kind and device.index != module.current_device():
            return module.device(device)
    return contextlib.nullcontext()


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


def _launch_fitting(*, plan: AttentionPlan, **args) -> None:
    """_launch with ``plan``, or with the first _smaller plan the GPU has the resources for
    (remembered, so the search runs once per process)."""
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
    with _device_guard(device):
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
            DOT_FP16=plan.fp16_dots_for_fp8 and k.dtype == FP8 and q.dtype == torch.bfloat16,
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


def paged_attention_supports(key: paged_spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key on ``platform``, else why not.
    The kernel reads any strides of the index tensors and sinks; rows must be contiguous."""
    if key.head_dim > MAX_HEAD_DIM:
        return f"head dim {key.head_dim} > {MAX_HEAD_DIM}: the register tiles would spill"
    for name in ("query", "k_cache", "v_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} has a non-unit stride along the head dim"
    group = key.num_heads // key.num_kv_heads
    kind = _kind(key.max_query_len_class, key.cache_dtype, mla=False)
    return _launch_limit(kind, platform, key.cache_dtype, group, key.num_seqs_class, key.num_tokens_class,
                         key.uniform_queries and key.decode)


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
    """The spec's paged_attention: one tiled launch (plus a merge when the KV range is split);
    arguments are validated by the caller."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0 or max_query_len == 0:
        return out.zero_()
    group = num_q_heads // k_cache.shape[2]
    kind = _kind(max_query_len, k_cache.dtype, mla=False)
    plan = plan_for(kind, query.device, seq_lens.shape[0], num_tokens, group, k_cache.shape[2],
                    max_query_len, max_seq_len, head_dim=head_dim)
    _launch_fitting(
        q=query, k=k_cache, v=v_cache, out=out, lse=None, cu_seqlens_q=cu_seqlens_q,
        block_table=block_table, seq_lens=seq_lens, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        max_query_len=max_query_len, scale=scale, causal=causal, window=sliding_window,
        soft_cap=logits_soft_cap, group=group, d_main=head_dim, d_rope=0, v_from_k=False, plan=plan,
    )
    return out


def mla_decode_supports(key: mla_spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key on ``platform``, else why not."""
    if key.width > MAX_MLA_WIDTH:
        return f"row width {key.width} > {MAX_MLA_WIDTH}: the register tiles would spill"
    for name in ("q", "kv_cache"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} has a non-unit stride along the row"
    kind = _kind(key.max_query_len, key.cache_dtype, mla=True)
    return _launch_limit(kind, platform, key.cache_dtype, key.num_heads, key.num_seqs_class,
                         key.num_tokens_class, key.uniform_queries and key.max_query_len <= 1)


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
    """The spec's mla_decode: the paged-attention kernel with one latent KV head, values taken
    from the key tile; arguments are validated by the caller."""
    num_tokens, num_heads, width = q.shape
    device = q.device
    out = torch.empty((num_tokens, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.empty((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    if num_tokens == 0 or max_query_len == 0:
        return out.zero_(), lse.zero_()
    kind = _kind(max_query_len, kv_cache.dtype, mla=True)
    plan = plan_for(kind, device, seq_lens.shape[0], num_tokens, num_heads, 1, max_query_len, max_seq_len,
                    head_dim=width)
    _launch_fitting(
        q=q, k=kv_cache, v=kv_cache, out=out, lse=lse if return_lse else None, cu_seqlens_q=cu_seqlens_q,
        block_table=block_table, seq_lens=seq_lens, sinks=None, k_scale=kv_scale, v_scale=kv_scale,
        max_query_len=max_query_len, scale=scale, causal=True, window=0, soft_cap=0.0, group=num_heads,
        d_main=kv_lora_rank, d_rope=width - kv_lora_rank, v_from_k=True, plan=plan,
    )
    return out, lse
