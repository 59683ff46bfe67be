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
      and the byte stride of every other dim. Strides of dims of one element count too: for a
      tensor torch laid out that changes nothing, and for a view it can only lower the
      alignment (a decline where a kernel could have read it, never a wrong read).
    """

    unit_stride: bool
    alignment: int

    @property
    def dense_rows(self) -> bool:
        """Unit stride along the last dim and 16-byte aligned rows: what vector loads need."""
        return self.unit_stride and self.alignment >= MAX_ALIGNMENT


def layout(tensor: Optional[torch.Tensor]) -> Optional[Layout]:
    """The ``Layout`` of ``tensor`` (None for None). It runs on every call, so it is kept cheap
    (~0.9 us): metadata reads only, no device sync, and one of the ten Layouts looked up rather
    than built."""
    if tensor is None:
        return None
    strides = tensor.stride()
    size = tensor.element_size()
    bits = tensor.data_ptr() | MAX_ALIGNMENT
    for stride in strides[:-1]:
        bits |= stride * size
    unit = not strides or strides[-1] == 1 or tensor.shape[-1] <= 1
    return _LAYOUTS[unit, bits & -bits]


_LAYOUTS = {(unit, 1 << bits): Layout(unit, 1 << bits)
            for unit in (True, False) for bits in range(MAX_ALIGNMENT.bit_length())}


def size_class(n: int) -> int:
    """The largest value of ``n``'s power-of-two class: 0, 1, 3, 7, 15, ... Keys hold sizes that
    change from batch to batch (tokens, sequences, query lengths) as classes, so a handful of
    keys cover every batch, while a limit of the form ``2**k - 1`` (CUDA's 65535 grid rows) is
    still decided exactly: ``n <= 2**k - 1`` exactly when ``size_class(n) <= 2**k - 1``."""
    return (1 << n.bit_length()) - 1
