"""The cuda backend's mla_decode on Hopper (kernels/mla_decode_sm90.cu): bf16/fp16 q over 576/512
latent caches of q's dtype or fp8 e4m3; the entry (``mla_decode``, ``supports``), its launch plan
from host ints (cached per device), and the launch of the decode kernel and the split-KV merge."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _compile, _driver, _merge, _params
from kernelmux.backends.cuda._paged_decode import split_count
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import mla_decode as mla_spec

__all__ = ["ARCH", "CAPABILITY", "LaunchPlan", "MlaPlan", "launch_plan", "mla_decode", "override_plan",
           "shape_reason", "source", "supports"]

FP8 = torch.float8_e4m3fn
CAPABILITY = HOPPER  # wgmma: sm_90a cubins run on sm_90 only
ARCH = f"sm_{CAPABILITY[0]}{CAPABILITY[1]}"
ROW_WIDTH, RANK = 576, 512  # the kernel's tiles are laid out for these
HEAD_TILE = 64  # heads per CTA (the wgmma M)
STEP = 64  # positions per step; cache blocks must hold a multiple
MIN_SPLIT_LEN = 4 * STEP  # shorter shares spend more on partials and the merge than they gain
MAX_SPLITS = _merge.MAX_SPLITS
MERGE_GROUPS = 1  # groups of 128 threads in the split-KV merge (perf/decisions/mla_decode.md)
# kSharedBytes in the .cu file: Q and two cache tiles (64 x 576 x 2 bytes each), P (64 x 64 x 2),
# the rows' rescale factors and sums (2 x 64 x 4), q's scale and four maxima (2 x 16), 1024 bytes
# of room to align the base. The kernel traps when launched with less.
SHARED_BYTES = 3 * 73728 + 8192 + 512 + 32 + 1024
THREADS = 256
SOURCE_NAME = "mla_decode_sm90.cu"
_LOG2E = 1.4426950408889634

_capability = probes.device_capability
_sm_count = probes.compute_units


@dataclass(frozen=True)
class MlaPlan:
    """A launch's choices: KV splits (None: split_count's)."""

    num_splits: Optional[int] = None


DEFAULT_PLAN = MlaPlan()


def _plan_problem(plan: MlaPlan) -> Optional[str]:
    splits = plan.num_splits
    if splits is not None and (type(splits) is not int or not 1 <= splits <= MAX_SPLITS):
        return f"num_splits must be an int in [1, {MAX_SPLITS}] or None, got {splits!r}"
    return None


_plans = PlanSetting("override_plan", DEFAULT_PLAN, _plan_problem)
override_plan = _plans.override_fields


def shape_reason(q_dtype: torch.dtype, cache_dtype: torch.dtype, width: int, rank: int,
                 block_size: int) -> Optional[str]:
    """Why the kernel does not take a call of this kind (None when it does); no device needed."""
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 q only, got {q_dtype}"
    if cache_dtype not in (q_dtype, FP8):
        return f"a cache of q's dtype ({q_dtype}) or fp8 e4m3 only, this cache is {cache_dtype}"
    if (width, rank) != (ROW_WIDTH, RANK):
        return f"rows of {ROW_WIDTH} with kv_lora_rank {RANK} only (the tile layouts), got {width} and {rank}"
    if block_size % STEP:
        return f"cache blocks of a multiple of {STEP} positions only, got {block_size}"
    return None


def supports(key: mla_spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key, else why not. The arch (sm_90,
    the kernel's wgmma) is the implementation's requirement, checked before this."""
    reason = shape_reason(key.q_dtype, key.cache_dtype, key.width, key.kv_lora_rank, key.block_size)
    if reason is not None:
        return reason
    if key.num_tokens_class > 65535:
        return (f"up to {key.num_tokens_class} query tokens (this batch's size class) > 65535, CUDA's limit "
                "on grid axis 1 (split the batch)")
    for name in ("q", "kv_cache"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along the row and 16-byte aligned data and row strides (the "
                    f"kernel's 16-byte copies), got {tensor_layout}")
    for name in ("cu_seqlens_q", "block_table", "seq_lens"):
        if not getattr(key, f"{name}_layout").unit_stride:
            return f"{name} needs a unit stride along its last dim (the kernel indexes it densely)"
    return None


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], bf16: bool,
              fp8: bool) -> tuple[_compile.CompiledModule, str, str]:
    """One NVRTC compilation per arch, macro set, q dtype and cache kind: (module, decode kernel
    name, merge kernel name)."""
    decode = f"mla_decode_sm90<{str(bf16).lower()}, {str(fp8).lower()}>"
    merge = _merge.kernel_name(RANK, MERGE_GROUPS, bf16)
    module = _compile.compile_module_cached(source([decode], [merge]), [decode, merge], arch, filename=SOURCE_NAME,
                                            arch_specific=True, defines=defines)
    return module, decode, merge


def source(decode: list[str], merge: list[str]) -> str:
    """kernels/mla_decode_sm90.cu with the named ABI's checks for the decode and merge kernels
    ``decode`` and ``merge``."""
    return _params.checked_source(SOURCE_NAME, [(_params.MlaDecodeParams, decode),
                                                (_params.MergeSplitsParams, merge)])


_LOADED = _driver.LoadedKernels()


def _kernels(device: torch.device, bf16: bool, fp8: bool) -> tuple[_driver.Kernel, ...]:
    """The decode and merge kernels loaded on ``device`` (cached per device and diagnostic
    macros)."""
    defines = _compile.diagnostics_in_force()

    def build():
        module, decode, merge = _compiled(_capability(device), defines, bf16, fp8)
        return module, [_driver.KernelSpec(decode, _params.MlaDecodeParams, THREADS, SHARED_BYTES),
                        _merge.kernel_spec(merge, MERGE_GROUPS)]

    return _LOADED.get(device, (defines, bf16, fp8), build)


@dataclass(frozen=True)
class LaunchPlan:
    """One call's launch, from host ints only: CTAs of HEAD_TILE heads per token, and KV splits."""

    tiles: int
    splits: int


@functools.lru_cache(maxsize=4096)
def launch_plan(device: torch.device, plan: MlaPlan, defines: tuple[str, ...], num_tokens: int, num_heads: int,
                q_bf16: bool, fp8: bool, max_seq_len: int) -> LaunchPlan:
    """The LaunchPlan of a call with these host ints on ``device`` under ``plan`` (cached: the
    occupancy split_count weighs is the loaded kernel's, under the diagnostic macros ``defines``)."""
    tiles = math.ceil(num_heads / HEAD_TILE)
    splits = plan.num_splits
    if splits is None:
        with torch.cuda.device(device):
            decode, _ = _kernels(device, q_bf16, fp8)
        splits = split_count(tiles * num_tokens, decode.blocks_per_sm * _sm_count(device), max_seq_len,
                             min_split_len=MIN_SPLIT_LEN, max_splits=MAX_SPLITS)
    return LaunchPlan(tiles, splits)


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
    """The spec's mla_decode on the wgmma kernel, plus a merge when it splits; arguments are
    validated by the caller and accepted by supports."""
    num_tokens, num_heads, _ = q.shape
    device = q.device
    out = torch.empty((num_tokens, num_heads, RANK), dtype=q.dtype, device=device)
    lse = torch.empty((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    if num_tokens == 0:
        return out, lse
    fp8, bf16 = kv_cache.dtype == FP8, q.dtype == torch.bfloat16
    plan = launch_plan(device, _plans.current, _compile.diagnostics_in_force(), num_tokens, num_heads, bf16, fp8,
                       max_seq_len)
    splits = plan.splits
    with torch.cuda.device(device):
        decode, merge = _kernels(device, bf16, fp8)
        part_acc, part_ml = _merge.partials(splits, num_tokens, num_heads, RANK, device) if splits > 1 else (None, None)
        # Every sequence has max_query_len queries when T == B * max_query_len (none has more):
        # the kernel then finds a token's sequence by a division instead of a search.
        q_per_seq = max_query_len if num_tokens == seq_lens.shape[0] * max_query_len else 0
        decode(
            (plan.tiles, num_tokens, splits),
            overlap_previous=True,  # PDL (sm_90a always has it): the launch hides under the previous kernel's end
            q=q, kv=kv_cache, out=out, lse=lse if return_lse else None, part_acc=part_acc, part_ml=part_ml,
            cu_seqlens_q=cu_seqlens_q, block_table=block_table, seq_lens=seq_lens,
            kv_scale=kv_scale if fp8 else None, num_seqs=seq_lens.shape[0], num_tokens=num_tokens,
            num_heads=num_heads, num_splits=splits, block_size=kv_cache.shape[1], q_per_seq=q_per_seq,
            scale_log2=float(scale) * _LOG2E, q_stride_t=q.stride(0), q_stride_h=q.stride(1),
            o_stride_t=out.stride(0), o_stride_h=out.stride(1),
            kv_stride_b=kv_cache.stride(0) * kv_cache.element_size(),
            kv_stride_p=kv_cache.stride(1) * kv_cache.element_size(), table_stride=block_table.stride(0),
        )
        if splits > 1:
            _merge.launch(merge, out, part_acc, part_ml, overlap_previous=True, lse=lse if return_lse else None)
    return out, lse
