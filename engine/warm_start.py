"""Warm starts: ahead of serving, build the native call fingerprint (engine/fingerprint.py) and run the
first call of exactly the implementation selection picks for each of an op's cases, so what it
compiles (Triton's JIT, NVRTC, a vendor's nvcc JIT) is in the on-disk caches the next process loads
from, and in this process. Each call is logged before it
starts (a compile can take minutes) and timed twice: first, and again, the difference being about
its compile cost. A record per device (``$KERNELMUX_CACHE_DIR/warmup/<device>.json``, with the
versions) lets ``kernelmux info`` say which ops' first calls are warm and which would still compile.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from kernelmux.engine import fingerprint, tuning
from kernelmux.engine.settings import cache_root
from kernelmux.errors import ConfigurationError, UnknownOpError
from kernelmux.platforms import synchronize

if TYPE_CHECKING:
    from kernelmux.engine._engine import Engine
    from kernelmux.registry import Implementation
    from kernelmux.specs import Case, OpSpec

__all__ = ["Warmed", "jit_caches", "record_path", "read_record", "warm_state", "warmup"]

SCHEMA = "kernelmux.warmup/1"


@dataclass(frozen=True)
class Warmed:
    """One warmed call: the op's case, the backend selection ran, and its first and second call's
    wall seconds (synchronized); ``error`` when the call raised (the engine reported it)."""

    op: str
    case: str
    backend: str
    first_s: float
    again_s: float
    jit: str  # the implementation's JitCache, described; "" when nothing compiles
    bucket: dict[str, Any]
    error: str = ""

    @property
    def compile_s(self) -> float:
        return max(self.first_s - self.again_s, 0.0)


def record_path(engine: "Engine") -> Optional[Path]:
    """This device's warm-up record, or None on a simulated platform (it has no caches)."""
    identity = tuning.device_identity(engine.platform)
    return None if identity is None else Path(cache_root()) / "warmup" / f"{tuning.slug(identity)}.json"


def read_record(engine: "Engine") -> Optional[dict[str, Any]]:
    """This device's warm-up record, or None when there is none (or it cannot be read)."""
    path = record_path(engine)
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None


def _cases(spec: "OpSpec", device: torch.device, names: Optional[set[str]], quick: bool) -> list["Case"]:
    if names is not None:
        return [c for c in spec.cases if c.name in names]
    return spec.model_cases(quick, device.type)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.2f} ms"


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def warmup(engine: Optional["Engine"] = None, ops: Optional[Iterable[str]] = None,
           cases: Optional[Iterable[str]] = None, quick: bool = False, seed: int = 0,
           log: Callable[[str], None] = lambda line: None, record: bool = True) -> list[Warmed]:
    """Run each op's (``ops``, default all) model cases (``--quick``: the quick ones; or the named
    ``cases``) through ``engine`` (default: the current one) on its platform's device, twice each,
    logging each call before it starts. Records what was warmed unless ``record`` is False."""
    if engine is None:
        from kernelmux.engine import current

        engine = current()
    if engine.platform.simulated:
        raise ConfigurationError("warmup compiles for this machine's device; a simulated platform has none")
    names = list(ops) if ops is not None else list(engine.specs)
    for name in names:
        if name not in engine.specs:
            raise UnknownOpError(name, list(engine.specs))
    wanted = set(cases) if cases is not None else None
    fingerprint.build_native(log)  # engines made after it (the server's process) skip Python's per-call cost
    device = engine.platform.device
    warmed: list[Warmed] = []
    for name in names:
        spec, dispatcher = engine.specs[name], engine.dispatchers[name]
        for case in _cases(spec, device, wanted, quick):
            kwargs = case.build(device, seed)
            key = spec.validate(**kwargs)
            dispatcher.resolve(**kwargs)  # decides the key: the backend is known before the call starts
            backend = dispatcher.decisions[key].backend
            impl = engine.registry.implementations.get((name, backend))
            jit = impl.jit.describe() if impl is not None and impl.jit is not None else ""
            log(f"warming {name} {case.name}: {backend}" + (f" (may compile: {jit})" if jit else ""))
            error = ""
            try:
                first = _timed(lambda: dispatcher(**kwargs), device)
                again = _timed(lambda: dispatcher(**kwargs), device)
            except Exception as failure:  # noqa: BLE001 - one op's failure is reported, the rest still warm
                first = again = 0.0
                error = f"{type(failure).__name__}: {failure}"
            item = Warmed(name, case.name, backend, round(first, 6), round(again, 6), jit, tuning.bucket(key), error)
            log(f"  failed: {error}" if error else f"  first call {_seconds(first)}, again {_seconds(again)}")
            warmed.append(item)
    if record and any(not item.error for item in warmed):
        _write_record(engine, warmed)
    return warmed


def _write_record(engine: "Engine", warmed: list[Warmed]) -> None:
    """Merge ``warmed`` into this device's record (same versions), atomically; a failed write only
    costs ``info`` its answer."""
    path = record_path(engine)
    if path is None:
        return
    installed = tuning.versions(engine.registry)
    old = read_record(engine) or {}
    entries = {} if old.get("versions") != installed else {
        (e["op"], json.dumps(e["bucket"], sort_keys=True), e["backend"]): e for e in old.get("entries", ())}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for item in warmed:
        if not item.error:
            entry = {k: v for k, v in asdict(item).items() if k != "error"}
            entries[item.op, json.dumps(item.bucket, sort_keys=True), item.backend] = dict(entry, when=stamp)
    data = {"schema": SCHEMA, "device": tuning.device_identity(engine.platform), "versions": installed,
            "entries": list(entries.values())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)
    except OSError:
        pass


def jit_caches(engine: "Engine", usage: bool = False) -> list[dict[str, Any]]:
    """Every compile cache the viable implementations here use: its directory, whether it exists,
    and with ``usage`` its files and bytes (a walk of the directory: for ``kernelmux info``, not for
    every ``kernelmux.report()``)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for table in engine.tables.values():
        for candidate in table.candidates:
            jit = candidate.impl.jit
            if jit is None:
                continue
            directory = jit.directory()
            entry = seen.setdefault((jit.name, directory), {
                "name": jit.name, "directory": directory, "backends": [],
                **(_usage(directory) if usage else {"exists": Path(directory).expanduser().is_dir()})})
            if candidate.impl.backend not in entry["backends"]:
                entry["backends"].append(candidate.impl.backend)
    return list(seen.values())


def _usage(directory: str) -> dict[str, Any]:
    files = size = 0
    root = Path(directory).expanduser()
    if not root.is_dir():
        return {"exists": False, "files": 0, "bytes": 0}
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                size += (Path(folder) / name).stat().st_size
                files += 1
            except OSError:
                continue
    return {"exists": True, "files": files, "bytes": size}


def warm_state(engine: "Engine", cache_usage: bool = False) -> dict[str, Any]:
    """What the first calls here would compile: per op, each viable implementation that compiles at
    its first call, the JIT it compiles with and the buckets ``kernelmux warmup`` warmed for it with
    these versions (a bucket not warmed compiles at its first call, and so does every bucket after a
    version change)."""
    simulated = engine.platform.simulated
    record = None if simulated else read_record(engine)
    installed = tuning.versions(engine.registry)
    current = record is not None and record.get("versions") == installed
    note = ("a simulated platform: no caches of its own" if simulated
            else "no warm-up record for this device (kernelmux warmup makes one)" if record is None
            else "the warm-up record is of other versions: first calls compile again" if not current else "")
    warmed: dict[tuple[str, str], int] = {}
    for entry in (record or {}).get("entries", ()) if current else ():
        warmed[entry["op"], entry["backend"]] = warmed.get((entry["op"], entry["backend"]), 0) + 1
    ops = {}
    for name, table in engine.tables.items():
        impls: list["Implementation"] = [c.impl for c in table.candidates]
        with_jit = [impl for impl in impls if impl.jit is not None]
        ops[name] = [{"backend": impl.backend, "jit": impl.jit.name, "variant": impl.jit.variant,
                      "warmed_buckets": warmed.get((name, impl.backend), 0)} for impl in with_jit]
    return {"record": str(record_path(engine) or ""), "current": current, "note": note,
            "caches": [] if simulated else jit_caches(engine, cache_usage), "ops": ops}
