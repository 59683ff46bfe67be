"""Tuning tables: measured rankings of every implementation of an op (the reference included) per
device and shape bucket, which order the candidates of a dispatch key ahead of static priorities.

A table is JSON (``SCHEMA``) written by ``kernelmux tune``. It names the device it was measured on
(kind, arch, name, compute units, clock class) and the versions it was measured with (kernelmux,
torch, triton, every plugin distribution and vendor library installed); one whose device differs is
not for this machine, one whose versions differ is ignored with a note in the report. Shipped tables
live in ``engine/tables``, the user's in ``$KERNELMUX_CACHE_DIR/tuning`` (default
``~/.cache/kernelmux/tuning``); a user measurement replaces a shipped one of the same op and bucket.

A bucket is a dispatch key without its device: the dims it holds, the batch-varying sizes already
bucketed as power-of-two classes (``size_class``). A call uses the measurement of its own bucket, or
failing that the nearest one that differs only in those classes (the fewest doublings apart), so a
few measured batch sizes cover every batch. Tensor layouts only count as present or absent: which
implementation accepts a layout is ``supports``' answer, not the table's. Implementations within
``TIE`` (3%) of the bucket's fastest count as tied and keep their priority order, the reference last.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

import torch

from kernelmux.engine.settings import cache_root

if TYPE_CHECKING:
    from kernelmux.platforms import Platform
    from kernelmux.registry import Registry

__all__ = [
    "SCHEMA",
    "TIE",
    "VENDOR_DISTRIBUTIONS",
    "Measurement",
    "Tables",
    "bucket",
    "device_identity",
    "load",
    "make_table",
    "same_device",
    "shipped_dir",
    "slug",
    "user_dir",
    "versions",
]

SCHEMA = "kernelmux.tuning/1"
# The vendor libraries kernelmux's own backends call: their versions are part of every table's
# fingerprint (a FlashInfer upgrade can reorder a ranking). tests/engine/test_tuning.py holds this
# list to every Vendor the backends declare.
VENDOR_DISTRIBUTIONS = ("amd-aiter", "apache-tvm-ffi", "flashinfer-python", "nvidia-cutlass-dsl", "sgl-deep-gemm",
                        "vllm-xpu-kernels")
_CLASS, _LAYOUT = "_class", "_layout"
TIE = 0.03  # implementations within 3% of a bucket's fastest are tied: priority orders them
CASE_SEPARATOR = ", "  # a measurement of cases sharing one bucket names them all, joined by this


def shipped_dir() -> Path:
    """The tables kernelmux ships, one per measured device."""
    return Path(__file__).resolve().parent / "tables"


def user_dir() -> Path:
    """The user's tables: $KERNELMUX_CACHE_DIR/tuning, else ~/.cache/kernelmux/tuning."""
    return Path(cache_root()) / "tuning"


def device_identity(platform: "Platform") -> Optional[dict[str, Any]]:
    """What a table must have been measured on to order this platform's calls: kind, arch, device
    name, compute units (SMs; on a CPU the threads torch uses) and clock class (100 MHz steps, where
    torch reports a clock). None for a simulated platform, which has no measurements."""
    if platform.simulated:
        return None
    units: Optional[int] = None
    clock: Optional[int] = None
    if platform.device.type == "cuda":
        props = torch.cuda.get_device_properties(platform.device)
        units = props.multi_processor_count
        rate = getattr(props, "clock_rate", None)  # kHz, where this torch exposes it
        clock = round(rate / 1e5) * 100 if rate else None
    elif platform.device.type == "cpu":
        units = torch.get_num_threads()
    return {"kind": platform.kind.value, "arch": platform.arch, "name": platform.device_name, "units": units,
            "clock_mhz": clock}


def same_device(recorded: Mapping[str, Any], identity: Mapping[str, Any]) -> bool:
    """Whether a table measured on ``recorded`` is for the device ``identity`` describes: kind, arch,
    name and units equal, and the clock class where both know it."""
    if any(recorded.get(k) != identity.get(k) for k in ("kind", "arch", "name", "units")):
        return False
    clocks = recorded.get("clock_mhz"), identity.get("clock_mhz")
    return None in clocks or clocks[0] == clocks[1]


def slug(identity: Mapping[str, Any]) -> str:
    """A file name for a device's table: cuda-sm_90-nvidia-h100-80gb-hbm3-132."""
    text = f"{identity['kind']}-{identity['arch']}-{identity['name']}-{identity['units']}".lower()
    return "".join(c if c.isalnum() or c == "_" else "-" for c in text).strip("-")


def versions(registry: "Registry") -> dict[str, Optional[str]]:
    """The fingerprint a table is valid for: kernelmux, torch and triton, every plugin's distribution
    and every vendor library kernelmux's backends call (None: not installed)."""
    def version(distribution: str) -> Optional[str]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    found: dict[str, Optional[str]] = {"kernelmux": version("kernelmux"), "torch": torch.__version__,
                                       "triton": version("triton")}
    for distribution in VENDOR_DISTRIBUTIONS:
        found[distribution] = version(distribution)
    for plugin in registry.plugins:
        if plugin.distribution and plugin.distribution not in ("?", "(api)"):
            found[plugin.distribution] = plugin.version
    return dict(sorted(found.items()))


def _plain(value: Any) -> Any:
    """A key field as JSON: dtypes by name, a layout as present (its values are supports' concern)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def bucket(key: Any) -> dict[str, Any]:
    """The bucket of a dispatch key: every field but the device, as JSON values."""
    return {name: (None if value is None else "present") if name.endswith(_LAYOUT) else _plain(value)
            for name, value in zip(key._fields, key) if name != "device"}


def _split(fields: Mapping[str, Any]) -> tuple[str, dict[str, int]]:
    """(the fields that must match exactly, as one string; the size classes, matched nearest)."""
    exact = {k: v for k, v in fields.items() if not k.endswith(_CLASS)}
    classes = {k: int(v) for k, v in fields.items() if k.endswith(_CLASS)}
    return json.dumps(exact, sort_keys=True), classes


def _distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    """Doublings between two sets of size classes (classes are 2**k - 1)."""
    return sum(abs(math.log2((a[k] + 1) / (b[k] + 1))) for k in a)


@dataclass(frozen=True)
class Measurement:
    """One op's times on one bucket: every implementation that ran it correctly, the reference too."""

    op: str
    bucket: Mapping[str, Any]
    case: str  # the spec cases measured, joined by CASE_SEPARATOR where several share the bucket
    times_us: Mapping[str, float]  # backend -> median microseconds
    source: str  # the table's file
    commit: str = ""

    @property
    def cases(self) -> tuple[str, ...]:
        """The spec cases measured."""
        return tuple(self.case.split(CASE_SEPARATOR))

    @property
    def ranking(self) -> tuple[str, ...]:
        """Backends fastest first."""
        return tuple(sorted(self.times_us, key=self.times_us.__getitem__))

    def describe(self, exact: bool = True) -> str:
        times = ", ".join(f"{b} {self.times_us[b]:.4g} us" for b in self.ranking)
        where = "this bucket" if exact else "the nearest measured batch-size class"
        return f"{Path(self.source).name}, case {self.case} ({where}): {times}"


@dataclass
class Tables:
    """The tables this engine orders its calls by, and what was ignored and why."""

    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _index: dict[str, dict[str, list[tuple[dict[str, int], Measurement]]]] = field(default_factory=dict)

    def add(self, measurement: Measurement) -> None:
        exact, classes = _split(measurement.bucket)
        entries = self._index.setdefault(measurement.op, {}).setdefault(exact, [])
        entries[:] = [(c, m) for c, m in entries if c != classes]  # a later table replaces the same bucket
        entries.append((classes, measurement))

    def lookup(self, op: str, key: Any) -> Optional[tuple[Measurement, bool]]:
        """The measurement that orders a call with dispatch ``key`` and whether it is the key's own
        bucket (else the nearest size classes), or None when no table measured one like it."""
        exact, classes = _split(bucket(key))
        entries = self._index.get(op, {}).get(exact)
        if not entries:
            return None
        # Entries with other size classes were measured under another version of the op's key.
        near = [(_distance(classes, c), m) for c, m in entries if c.keys() == classes.keys()]
        if not near:
            return None
        distance, measurement = min(near, key=lambda e: e[0])
        return measurement, distance == 0

    def measurements(self) -> list[Measurement]:
        return [m for by_exact in self._index.values() for entries in by_exact.values() for _, m in entries]


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA!r}")
    return data


def _differences(recorded: Mapping[str, Any], installed: Mapping[str, Any]) -> list[str]:
    return [f"{name} {recorded.get(name) or 'absent'} measured, {installed.get(name) or 'absent'} installed"
            for name in sorted(set(recorded) | set(installed)) if recorded.get(name) != installed.get(name)]


def load(platform: "Platform", registry: "Registry", directories: Optional[Iterable[Path]] = None,
         enabled: bool = True) -> Tables:
    """The tables for ``platform``'s device from ``directories`` (default: shipped, then the
    user's), each checked against the installed versions; none when not ``enabled``."""
    tables = Tables()
    if not enabled:
        tables.notes.append("tuning tables off (KERNELMUX_TUNING=off or configure(tuning=False)): priorities "
                            "order every call")
        return tables
    try:
        identity = device_identity(platform)
    except Exception as error:  # noqa: BLE001 - a failed device query costs the tables, never the engine
        tables.notes.append(f"no tuning tables: the device could not be identified ({type(error).__name__}: {error})")
        return tables
    if identity is None:
        return tables
    installed = versions(registry)
    for directory in directories if directories is not None else (shipped_dir(), user_dir()):
        for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else ():
            try:
                data = _read(path)
            except (OSError, ValueError) as error:
                tables.notes.append(f"{path}: ignored, unreadable ({error})")
                continue
            if not same_device(data.get("device") or {}, identity):
                continue  # another device's table
            differences = _differences(data.get("versions", {}), installed)
            if differences:
                tables.notes.append(f"{path}: ignored, measured with other versions ({'; '.join(differences)})")
                continue
            tables.sources.append(str(path))
            for entry in data.get("measurements", ()):
                tables.add(Measurement(entry["op"], entry["bucket"], entry["case"], entry["times_us"], str(path),
                                       data.get("commit", "")))
    return tables


def make_table(rows: Iterable[Mapping[str, Any]], buckets: Mapping[tuple[str, str], Mapping[str, Any]],
               identity: Mapping[str, Any], installed: Mapping[str, Any], commit: str = "",
               timestamp: str = "") -> dict[str, Any]:
    """A table from bench rows (``perf/runner.py``'s): per (op, bucket), the median of every ``ok``
    row that was timed. Cases that share a bucket (two batches of one size class, say) are one
    measurement: each backend timed on all of them at the geometric mean of its times, so every
    case weighs the same."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        if row.get("status") == "ok" and row.get("median_us") is not None:
            times.setdefault((row["op"], row["case"]), {})[row["backend"]] = float(row["median_us"])
    grouped: dict[tuple[str, str], list[tuple[str, dict[str, float]]]] = {}
    for (op, case), t in times.items():
        if (op, case) in buckets and len(t) >= 2:
            grouped.setdefault((op, json.dumps(buckets[op, case], sort_keys=True)), []).append((case, t))
    measurements = []
    for (op, key), cases in grouped.items():
        common = set.intersection(*(set(t) for _, t in cases))
        if len(common) < 2:
            continue
        mean = {b: round(math.exp(sum(math.log(t[b]) for _, t in cases) / len(cases)), 3) for b in sorted(common)}
        measurements.append({"op": op, "case": CASE_SEPARATOR.join(case for case, _ in cases),
                             "bucket": json.loads(key), "times_us": mean})
    return {"schema": SCHEMA, "device": dict(identity), "versions": dict(installed), "commit": commit,
            "timestamp": timestamp, "measurements": measurements}
