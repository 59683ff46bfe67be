"""Records: where one was measured (device, versions, commit: every perf/diag script's ``header()``,
the commit of the bench's ``environment``), and where a device's bench is kept: the device key and
perf/baselines/<device>.json and .md, written by ``kernelmux bench --record``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from kernelmux.engine.report import distribution_version
from kernelmux.engine.settings import env_value

__all__ = ["BASELINES", "baseline_path", "baselines", "commit", "device_key", "driver_version", "dumps", "header",
           "write_baseline"]

# perf/baselines/<device>.json (the run) and .md (its markdown): the current full bench of each device.
BASELINES: Path = Path(__file__).resolve().parent / "baselines"
# Words of a device name that name the vendor or the product line, not the model.
_VENDOR_WORDS = frozenset({"nvidia", "amd", "intel", "r", "tm", "geforce", "tesla", "quadro", "instinct", "radeon",
                           "data", "center", "gpu", "graphics"})
# Variants of one model that differ in memory or power and so in their numbers: kept in the key.
_VARIANT_WORDS = ("pcie", "nvl")


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


def device_key(environment: dict[str, Any]) -> str:
    """The key of a bench run's device in perf/baselines: a CPU run is ``cpu-<machine>``
    (``cpu-x86_64``, ``cpu-aarch64``); a GPU run is its model from the device name, lower case,
    without the vendor's words, plus ``-pcie`` or ``-nvl`` where the name says so ("NVIDIA H100
    80GB HBM3" -> ``h100``, "NVIDIA H200" -> ``h200``, "NVIDIA H100 PCIe" -> ``h100-pcie``,
    "NVIDIA GeForce RTX 4090" -> ``rtx4090``, "AMD Instinct MI300X" -> ``mi300x``)."""
    if environment.get("device") == "cpu":
        machine = environment.get("machine") or environment.get("arch") or "unknown"
        return "cpu-" + re.sub(r"[^a-z0-9_]+", "-", machine.lower()).strip("-")
    words = [w for w in re.findall(r"[a-z0-9]+", (environment.get("device_name") or "").lower())
             if w not in _VENDOR_WORDS]
    model = []
    for word in words:  # up to the first word with a digit: "rtx", "4090" -> rtx4090
        model.append(word)
        if any(c.isdigit() for c in word):
            break
    if not model or not any(c.isdigit() for c in model[-1]):
        return "-".join(words) or "unknown"
    return "".join(model) + "".join(f"-{w}" for w in _VARIANT_WORDS if w in words)


def baseline_path(key: str, directory: Optional[Path] = None) -> Path:
    """perf/baselines/<key>.json (or under ``directory``): the run that ``kernelmux bench
    --compare`` reads by default."""
    return (directory or BASELINES) / f"{key}.json"


def baselines(directory: Optional[Path] = None) -> dict[str, dict[str, Any]]:
    """Every recorded run, by device key (sorted)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((directory or BASELINES).glob("*.json"))}


def dumps(result: dict[str, Any]) -> str:
    """A run as a baseline's JSON: each top-level key on a line, and each row on its own line, so a
    new record's diff shows the rows that moved (and the file is a fifth smaller than indented)."""
    def line(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    parts = []
    for key, value in result.items():
        if key == "rows":
            rows = ",\n".join("  " + line(row) for row in value)
            parts.append(f' "rows":[\n{rows}\n ]')
        else:
            parts.append(f" {line(key)}:{line(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_baseline(result: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
                   directory: Optional[Path] = None) -> list[Path]:
    """Write ``result`` as the baseline of its device: <key>.json and <key>.md (``markdown(result)``);
    return both paths."""
    path = baseline_path(device_key(result["environment"]), directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(result))
    md = path.with_suffix(".md")
    md.write_text(markdown(result))
    return [path, md]
