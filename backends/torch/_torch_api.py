"""What the installed torch offers the torch backend: its version, which scaled-mm API it has
(``torch.nn.functional.scaled_mm``, else ``torch._scaled_mm``), ``torch._grouped_mm`` and the KleidiAI
int4 ops; and the static checks built on them, asked once per platform."""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch

from kernelmux.backends._vendor import VendorCall
from kernelmux.platforms import Platform

__all__ = ["INT4_CALLS", "MIN_TORCH", "V1", "V2", "grouped_mm_problem", "kleidiai_problem", "scaled_mm_api",
           "scaled_mm_problem", "torch_version"]

# The scale layouts and the grouped_mm fast path were read from torch's source of the 2.10-2.12
# era (aten/src/ATen/native/cuda/ScaledBlas.cpp, GroupedBlas.cpp, GroupedMMUtils.h); the scaled-mm
# v2 API (torch.nn.functional.scaled_mm) arrived in 2.10.
MIN_TORCH = (2, 10)
V1, V2 = "torch._scaled_mm", "torch.nn.functional.scaled_mm"


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch (``2.11.0+cu130`` -> (2, 11))."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


@functools.cache
def scaled_mm_api() -> Optional[str]:
    """The scaled-mm entry point this torch has: V2 (public, explicit scale recipes), else V1, else None."""
    functional = torch.nn.functional
    if hasattr(functional, "scaled_mm") and hasattr(functional, "ScalingType") and hasattr(functional, "SwizzleType"):
        return V2
    if hasattr(torch, "_scaled_mm"):
        return V1
    return None


def _version_problem() -> Optional[str]:
    have = torch_version()
    if have < MIN_TORCH:
        return (f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the torch whose "
                "scaled_mm/grouped_mm source these layouts were read from (pip install -U torch)")
    return None


def scaled_mm_problem(platform: Platform) -> Optional[str]:
    """Why torch's scaled mm cannot serve kernelmux's scaled_mm on ``platform``, or None."""
    reason = _version_problem()
    if reason is None and scaled_mm_api() is None:
        reason = f"torch {torch.__version__} has neither {V2} nor {V1}"
    return reason


def grouped_mm_problem(platform: Platform) -> Optional[str]:
    """Why torch's grouped mm cannot serve kernelmux's fused_moe on ``platform``, or None."""
    reason = _version_problem()
    if reason is not None:
        return reason
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    capability = platform.capability
    # _grouped_mm_cuda takes its CUTLASS fast path (offsets read on the device) on major 9 and 10
    # only (scaled_mm_arch_allowed(sm90_only, sm100_only)); elsewhere _grouped_mm_fallback loops
    # over groups reading offs on the host: a device sync per call, not capturable.
    if capability is None or capability[0] not in (9, 10):
        return (f"torch's grouped_mm runs without a host sync on sm_90/sm_100 only (its CUTLASS path); "
                f"on {platform.arch} it loops over experts reading offsets on the host")
    return None


# The torch ops int4_mm calls and the keywords it passes (their schema names), probed at startup.
INT4_CALLS = (
    VendorCall("torch", "ops.aten._dyn_quant_pack_4bit_weight",
               ("weights", "scales_zeros", "bias", "block_size", "in_features", "out_features")),
    VendorCall("torch", "ops.aten._dyn_quant_matmul_4bit",
               ("inp", "packed_weights", "block_size", "in_features", "out_features")),
)


def kleidiai_problem(platform: Platform) -> Optional[str]:
    """Why torch cannot run KleidiAI's int4 GEMM on ``platform`` (None when it can): the installed
    torch lacks an op or a keyword kernelmux passes, or, on real (not simulated) hardware, it was
    built without KleidiAI, where both ops run a scalar reference path instead."""
    for call in INT4_CALLS:
        reason = call.problem()
        if reason is not None:
            return f"torch {torch.__version__}: {reason}"
    if platform.simulated:
        return None
    kleidiai = getattr(torch.backends, "kleidiai", None)
    if kleidiai is None or not kleidiai.is_available():
        return (f"torch {torch.__version__} was built without KleidiAI (torch.backends.kleidiai.is_available() "
                "is False): its int4 ops would run their scalar reference path")
    return None
