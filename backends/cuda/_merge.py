"""The split-KV merge's host side (kernels/split_kv_merge.cuh), one for the fp8 paged decode and
the MLA decode: its kernel name, launch spec, partial buffers and launch."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cuda import _driver, _params

__all__ = ["MAX_SPLITS", "kernel_name", "kernel_spec", "launch", "partials"]

MAX_SPLITS = 64  # kMergeMaxSplits: one thread per split reads its max and sum
GROUP = 128  # kMergeGroup: the threads summing one share of the splits


def kernel_name(dim: int, groups: int, q_bf16: bool) -> str:
    """The C++ name of the merge for rows of ``dim`` values (128 or 512) of q's dtype, by
    ``groups`` (1 or 2) groups of GROUP threads, each summing its share of the splits."""
    return f"merge_splits<{dim}, {groups}, {str(q_bf16).lower()}>"


def kernel_spec(name: str, groups: int) -> _driver.KernelSpec:
    return _driver.KernelSpec(name, _params.MergeSplitsParams, groups * GROUP)


def partials(splits: int, num_tokens: int, num_heads: int, dim: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernels' split outputs: part_acc [S, T, H, dim] and part_ml [2, S, T, H]."""
    return (torch.empty((splits, num_tokens, num_heads, dim), dtype=torch.float32, device=device),
            torch.empty((2, splits, num_tokens, num_heads), dtype=torch.float32, device=device))


def launch(merge: _driver.Kernel, out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, *,
           overlap_previous: bool, lse: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
           launch_next_early: bool = False) -> None:
    """Merge the splits into ``out`` [T, H, dim] (and ``lse`` [T, H] if given); one CTA per
    (token, head)."""
    splits, num_tokens, num_heads = part_ml.shape[1:]
    merge((num_tokens, num_heads, 1), overlap_previous=overlap_previous, out=out, lse=lse, part_acc=part_acc,
          part_ml=part_ml, sinks=sinks, num_tokens=num_tokens, num_heads=num_heads, num_splits=splits,
          launch_next_early=int(launch_next_early), o_stride_t=out.stride(0), o_stride_h=out.stride(1))
