"""What the cuda backend's kernels require of their tensors' layouts, checked on the host: 16-byte
aligned rows (their vector copies) and power-of-two cache blocks (their position -> block shifts)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def page_shift(block_size: int) -> Optional[int]:
    """log2(block_size), or None when it is not a power of two."""
    if block_size < 1 or block_size & (block_size - 1):
        return None
    return block_size.bit_length() - 1


def vector_alignment_problem(tensors: Iterable[tuple[str, torch.Tensor, int]],
                             row: str) -> Optional[tuple[str, str, str]]:
    """(argument, expected, actual) for the first of ``tensors`` (name, tensor, leading dims whose
    strides the kernel steps by) that breaks 16-byte vector loads of its rows (``row`` names the
    last dim in the message); None when all are fine. Every cuda kernel's host side uses it."""
    for name, tensor, dims in tensors:
        if tensor.stride(-1) != 1:
            return name, f"a unit stride along {row}", f"stride {tensor.stride(-1)}"
        size, strides = tensor.element_size(), tensor.stride()[:dims]
        if tensor.data_ptr() % 16 or any(s * size % 16 for s in strides):
            return (name, "16-byte aligned data and row strides",
                    f"address {tensor.data_ptr():#x}, byte strides {[s * size for s in strides]}")
    return None
