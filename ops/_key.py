"""The dispatch key's vocabulary beyond dtypes and dims: a tensor's memory layout and a size's class.

Implementations decide whether they take a call from its key alone (``supports(key, platform)``),
so everything a kernel's addressing depends on must be in it; each spec's ``validate`` builds its
key from these.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["MAX_ALIGNMENT", "Layout", "layout", "size_class"]

# Bytes: the widest vector access a kernel makes (16-byte loads, TMA strides). Larger alignments
# would only multiply the keys.
MAX_ALIGNMENT = 16


class Layout(NamedTuple):
    """How a tensor lies in memory, as far as a kernel's address arithmetic cares.

    - ``unit_stride``: its last dim is contiguous (stride 1, or at most one element).
    - ``alignment``: the largest power of two, up to ``MAX_ALIGNMENT`` bytes, dividing its address
      and the byte stride of every other dim of more than one element (a kernel never steps
      along a dim of one element).
    """

    unit_stride: bool
    alignment: int

    @property
    def dense_rows(self) -> bool:
        """Unit stride along the last dim and 16-byte aligned rows: what vector loads need."""
        return self.unit_stride and self.alignment >= MAX_ALIGNMENT


def layout(tensor: Optional[torch.Tensor]) -> Optional[Layout]:
    """The ``Layout`` of ``tensor`` (None for None). Cheap: metadata reads only, no device sync."""
    if tensor is None:
        return None
    shape, strides = tensor.shape, tensor.stride()
    if not shape:
        return Layout(True, _alignment(tensor.data_ptr()))
    bits = tensor.data_ptr()
    size = tensor.element_size()
    for extent, stride in zip(shape[:-1], strides[:-1]):
        if extent > 1:
            bits |= stride * size
    return Layout(strides[-1] == 1 or shape[-1] <= 1, _alignment(bits))


def _alignment(bits: int) -> int:
    bits |= MAX_ALIGNMENT
    return bits & -bits


def size_class(n: int) -> int:
    """The largest value of ``n``'s power-of-two class: 0, 1, 3, 7, 15, ... Keys hold sizes that
    change from batch to batch (tokens, sequences, query lengths) as classes, so a handful of
    keys cover every batch, while a limit of the form ``2**k - 1`` (CUDA's 65535 grid rows) is
    still decided exactly: ``n <= 2**k - 1`` exactly when ``size_class(n) <= 2**k - 1``."""
    return (1 << n.bit_length()) - 1
