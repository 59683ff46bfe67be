"""Where a record under perf/results was measured: the device, the versions and the commit. The
bench writes the fuller ``bench.environment`` (which takes its commit from here); every perf/diag
script starts its record with ``header()``, so all of them say the same things the same way."""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from typing import Any, Optional

import torch

from kernelmux.engine.report import distribution_version
from kernelmux.engine.settings import env_value


def commit() -> str:
    """$KERNELMUX_COMMIT when set (the device machines get the tree without .git), else the
    checkout's short HEAD, else "unknown"."""
    if env_value("KERNELMUX_COMMIT"):
        return env_value("KERNELMUX_COMMIT")
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version from nvidia-smi (None without one)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def header(device: Any = None) -> dict[str, Any]:
    """``{"device", "torch", "triton", "commit", "timestamp"}`` for a record measured on the CUDA
    device ``device`` (None: the current one)."""
    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": distribution_version("triton"),
        "commit": commit(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
