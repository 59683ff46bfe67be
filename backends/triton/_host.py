"""Host-side helpers every op of the triton backend shares (no Triton import: the backend registers
on machines without it)."""

import contextlib
import functools
import os

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.platforms import Platform, PlatformKind, probes

# Triton reads TRITON_INTERPRET when a kernel is decorated (the kernel modules' first import), so
# the process's value at start-up is the one its kernels run under.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
# The fp4 formats' constexpr codes in the kernels (_fp4_kernel.MXFP4, NVFP4; fused_moe's QUANT modes use them too).
FP4_FORMATS = {"mxfp4": 3, "nvfp4": 4}
# Whether fp8 launches take the integer route even where the hardware cast exists.
_force_software_fp8 = ScopedSetting("force_software_fp8", False)


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR, else $TRITON_HOME (default ~)/.triton/cache."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block dims must be powers of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


# Units compute_units reports off the GPU (the interpreter): a few, so that launches sized to fill a GPU's
# SMs (split-KV, split-K) still take their multi-program routes in CPU tests.
INTERPRETER_UNITS = 4


def compute_units(device: torch.device) -> int:
    """Units a program runs on (probes.compute_units); INTERPRETER_UNITS off cuda and xpu."""
    return probes.compute_units(device) if device.type in ("cuda", "xpu") else INTERPRETER_UNITS


@functools.cache
def table_name(device: torch.device) -> str:
    """The name the backend's measured launch tables are keyed by ("" under the interpreter and off CUDA:
    the heuristics); the platform probe Platform.device_name comes from, so describe() and a call key
    the same row (platform_table_name)."""
    if INTERPRETED or device.type != "cuda":
        return ""
    return probes.device_name("cuda", device.index if device.index is not None else probes.current_index("cuda"))


def platform_table_name(platform: Platform) -> str:
    """table_name for the platform explain describes."""
    return "" if INTERPRETED or platform.kind != PlatformKind.CUDA else platform.device_name


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch (Triton launches on the current device); a no-op
    context when it already is, so the common path pays nothing."""
    for kind, module in (("cuda", torch.cuda), ("xpu", torch.xpu)):
        if device.type == kind and device.index != module.current_device():
            return module.device(device)
    return contextlib.nullcontext()


def force_software_fp8(force: bool = True) -> contextlib.AbstractContextManager[bool]:
    """Make fp8 launches use the kernel's integer route even where the hardware cast exists
    (tests: both routes against the reference on the GPU); restores the previous setting."""
    return _force_software_fp8.override(force)


@functools.cache
def _has_native_e4m3_cast(index: int) -> bool:
    # Triton accepts fp8e4nv casts from sm_89 on (Ada, Hopper, Blackwell): cvt ... e4m3x2.f32.
    return probes.capability(index) >= (8, 9)


def native_fp8_cast(device: torch.device) -> bool:
    """Whether fp8 launches on ``device`` convert with the hardware cast (CUDA, not ROCm, compute
    capability >= 8.9, not under the interpreter, not forced off); else the integer route."""
    if _force_software_fp8.current or device.type != "cuda" or probes.is_rocm():
        return False
    if INTERPRETED:
        return False
    index = device.index if device.index is not None else probes.current_index("cuda")
    return _has_native_e4m3_cast(index)
