"""What the cuda backend's kernels require of a cache's shape, checked on the host: power-of-two
blocks (their position -> block shifts). Their tensors' layouts are in the dispatch key
(specs/_key.py's Layout), decided by each kernel's supports()."""

from __future__ import annotations

from typing import Optional


def page_shift(block_size: int) -> Optional[int]:
    """log2(block_size), or None when it is not a power of two."""
    if block_size < 1 or block_size & (block_size - 1):
        return None
    return block_size.bit_length() - 1
