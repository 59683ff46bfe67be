"""Hardware probes: every question kernelmux asks the machine, each taking the device it is about.

Detection (``platform.detect``) reads the machine only through these functions, so tests fake the
machine by passing an object with the same functions.
"""

from __future__ import annotations

import functools
import platform as _stdlib_platform

import torch

__all__ = [
    "capability",
    "cpu_arch",
    "cpu_flags",
    "cpu_name",
    "current_index",
    "default_device",
    "device_name",
    "is_rocm",
    "rocm_gcn_arch",
]


def default_device() -> torch.device:
    """The first accelerator torch can use, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", 0)
    return torch.device("cpu")


def current_index(device_type: str) -> int:
    return getattr(torch, device_type).current_device()


def is_rocm() -> bool:
    return torch.version.hip is not None


def capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def device_capability(device: torch.device) -> tuple[int, int]:
    """capability() of a CUDA torch device: its index, or the current one when it has none.
    Cached per index (backends ask on every call)."""
    return _cached_capability(device.index if device.index is not None else current_index("cuda"))


_cached_capability = functools.cache(capability)


def compute_units(device: torch.device) -> int:
    """Units a GPU program runs on: SMs (NVIDIA), CUs (ROCm), Xe-cores (Intel). Cached per device
    index (backends ask on every call)."""
    if device.type not in ("cuda", "xpu"):
        raise ValueError(f"compute_units: device must be a cuda or xpu device, got {device}")
    index = device.index if device.index is not None else current_index(device.type)
    return _compute_units(device.type, index)


@functools.cache
def _compute_units(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return torch.xpu.get_device_properties(index).gpu_subslice_count


def device_name(device_type: str, index: int) -> str:
    return getattr(torch, device_type).get_device_name(index)


def rocm_gcn_arch(index: int) -> str:
    # gcnArchName looks like "gfx942:sramecc+:xnack-"; the arch is the part before the first colon.
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def cpu_arch() -> str:
    machine = _stdlib_platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """ISA flags as the kernel lists them (x86 'flags', Arm 'Features', s390x 'features')."""
    flags: set[str] = set()
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def cpu_name() -> str:
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "CPU part", "processor 0"):
            return value.strip()
    return _stdlib_platform.processor() or cpu_arch()
