"""Host side of the cuda backend's mla_decode on Hopper: 16-bit latent caches at DeepSeek's
576/512 widths (kernel: mla_decode_sm90.cu, which says how it works).

Scope: sm_90 GPUs (the kernel is built for sm_90a: warpgroup MMAs), bf16 or fp16 q over a cache
of the same dtype or of fp8 e4m3 (with or without kv_scale: converted exactly to fp16 on the way
into shared memory, with a bf16 q converted once to fp16 under a power-of-two scale), 576-wide
rows of which the first 512 are the values, cache blocks of a multiple of 64 positions, any head
count (64-head tiles, the last one padded), any q_len (one CTA per query token and head tile, so
decode and MTP alike), with or without lse. Other widths and other GPUs are the triton
backend's: ``mla_decode_supports`` says why per call, and dispatch moves on.

Launch: one CTA (two warpgroups, 225 KiB of shared memory, so one per SM) per head tile, query
token and KV split. Splits come from host ints only (``attention.split_count`` with one CTA per
SM and shares of at least four 64-position steps) and are merged by a second kernel, so CUDA
graphs stay valid when lengths and tables change under them. First call per (arch, q dtype, cache
kind): one NVRTC compilation, 0.6-0.9 s on a 2-core VM, kept on disk (_nvrtc.compile_module_cached:
later processes load the cubin), then one module load per device. No autotuning.
"""

from __future__ import annotations

import functools
import math
import pathlib
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import PlanSetting
from kernelmux.backends.cuda import _nvrtc
from kernelmux.backends.cuda.attention import split_count
from kernelmux.platforms import Platform, probes
from kernelmux.specs import mla_decode as mla_spec

__all__ = ["ARCH", "CAPABILITY", "MlaPlan", "mla_decode", "mla_decode_supports", "override_plan", "shape_reason"]

FP8 = torch.float8_e4m3fn
CAPABILITY = (9, 0)  # wgmma: sm_90a cubins run on sm_90 only
ARCH = f"sm_{CAPABILITY[0]}{CAPABILITY[1]}"
ROW_WIDTH, RANK = 576, 512  # the kernel's tiles are laid out for these
HEAD_TILE = 64  # heads per CTA (the wgmma M)
STEP = 64  # positions per step; cache blocks must hold a multiple
MIN_SPLIT_LEN = 4 * STEP  # shorter shares spend more on partials and the merge than they gain
MAX_SPLITS = 64
# kSharedBytes in the .cu file: Q and two cache tiles (64 x 576 x 2 bytes each), P (64 x 64 x 2),
# the rows' rescale factors and sums (2 x 64 x 4), q's scale and four maxima (2 x 16), 1024 bytes
# of room to align the base. The kernel traps when launched with less.
SHARED_BYTES = 3 * 73728 + 8192 + 512 + 32 + 1024
THREADS = 256
_SOURCE = pathlib.Path(__file__).with_name("mla_decode_sm90.cu")
# The kernels' arguments (see the .cu file): p pointer, i int32, q int64, f float32.
_DECODE_SIGNATURE = "pppppppppp" + "iiiiii" + "f" + "qqqqqqq"
_MERGE_SIGNATURE = "pppp" + "iii" + "qq"
_LOG2E = 1.4426950408889634
# Macros defined for the compilation (perf/diag/cuda_mla_ablation.py sets them).
_DEFINES: tuple[str, ...] = ()

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


def mla_decode_supports(key: mla_spec.Key, platform: Platform) -> Optional[str]:
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
              fp8: bool) -> tuple[_nvrtc.CompiledModule, str, str]:
    """One NVRTC compilation per arch, macro set, q dtype and cache kind: (module, decode kernel
    name, merge kernel name)."""
    flag = str(bf16).lower()
    decode, merge = f"mla_decode_sm90<{flag}, {str(fp8).lower()}>", f"merge_mla_splits<{flag}>"
    module = _nvrtc.compile_module_cached(_SOURCE.read_text(), [decode, merge], arch, filename=_SOURCE.name,
                                          arch_specific=True, defines=defines)
    return module, decode, merge


_LOADED = _nvrtc.LoadedKernels()


def _kernels(device: torch.device, bf16: bool, fp8: bool) -> tuple[_nvrtc.Kernel, ...]:
    """The decode and merge kernels loaded on ``device`` (cached per device)."""
    def build():
        module, decode, merge = _compiled(_capability(device), _DEFINES, bf16, fp8)
        return module, [_nvrtc.KernelSpec(decode, _DECODE_SIGNATURE, THREADS, SHARED_BYTES),
                        _nvrtc.KernelSpec(merge, _MERGE_SIGNATURE, RANK // 4)]

    return _LOADED.get(device, (_DEFINES, bf16, fp8), build)


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
    validated by the caller and accepted by mla_decode_supports."""
    num_tokens, num_heads, _ = q.shape
    device = q.device
    out = torch.empty((num_tokens, num_heads, RANK), dtype=q.dtype, device=device)
    lse = torch.empty((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    if num_tokens == 0:
        return out, lse
    tiles = math.ceil(num_heads / HEAD_TILE)
    plan = _plans.current
    with torch.cuda.device(device):
        fp8 = kv_cache.dtype == FP8
        decode, merge = _kernels(device, q.dtype == torch.bfloat16, fp8)
        splits = plan.num_splits
        if splits is None:
            splits = split_count(tiles * num_tokens, decode.blocks_per_sm * _sm_count(device), max_seq_len,
                                 min_split_len=MIN_SPLIT_LEN, max_splits=MAX_SPLITS)
        if splits > 1:
            part_acc = torch.empty((splits, num_tokens, num_heads, RANK), dtype=torch.float32, device=device)
            part_ml = torch.empty((2, splits, num_tokens, num_heads), dtype=torch.float32, device=device)
        else:
            part_acc = part_ml = None
        decode(
            (tiles, num_tokens, splits),
            q, kv_cache, out, lse if return_lse else None, part_acc, part_ml, cu_seqlens_q, block_table,
            seq_lens, kv_scale if fp8 else None,
            seq_lens.shape[0], num_tokens, num_heads, splits, kv_cache.shape[1],
            # Every sequence has max_query_len queries when T == B * max_query_len (none has more):
            # the kernel then finds a token's sequence by a division instead of a search.
            max_query_len if num_tokens == seq_lens.shape[0] * max_query_len else 0,
            float(scale) * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0) * kv_cache.element_size(), kv_cache.stride(1) * kv_cache.element_size(),
            block_table.stride(0),
            overlap_previous=True,  # PDL (sm_90a always has it): the launch hides under the previous kernel's end
        )
        if splits > 1:
            merge((num_tokens, num_heads, 1), out, lse if return_lse else None, part_acc, part_ml, num_tokens,
                  num_heads, splits, out.stride(0), out.stride(1), overlap_previous=True)
    return out, lse
