"""Host-side helpers every op of the triton backend shares (no Triton import: the backend registers
on machines without it)."""

import contextlib
import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated (the kernel modules' first import), so
# the process's value at start-up is the one its kernels run under.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR, else $TRITON_HOME (default ~)/.triton/cache."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block dims must be powers of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch (Triton launches on the current device); a no-op
    context when it already is, so the common path pays nothing."""
    for kind, module in (("cuda", torch.cuda), ("xpu", torch.xpu)):
        if device.type == kind and device.index != module.current_device():
            return module.device(device)
    return contextlib.nullcontext()
