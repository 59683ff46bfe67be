"""Host-side helpers shared by the triton backend's ops (no Triton import: the backend registers
on machines without it)."""

import os

# Triton reads TRITON_INTERPRET when a kernel is decorated (the kernel modules' first import), so
# the process's value at start-up is the one its kernels run under.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block dims must be powers of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
