"""How a backend over a vendor library meets it: the library imported lazily and once, any exception
at import (not only ImportError) turned into a reason naming the installed version; the installed
version held to the range kernelmux was tested with; every vendor function an op calls probed for
the keywords it passes (a failed probe rejects that op only); and a vendor's first call per variant,
which may compile for minutes, logged before it starts and timed."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Hashable, Optional

__all__ = ["Vendor", "VendorCall", "first_calls"]

_log = logging.getLogger("kernelmux.vendor")
Version = tuple[int, ...]


def _release(text: str) -> Version:
    """The numeric release of a version string: "0.6.14" -> (0, 6, 14), "0.1.4.post1" -> (0, 1, 4)."""
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class VendorCall:
    """A vendor function kernelmux calls: where it lives and the keywords every call passes. With no
    function it is a module that must import (a compiled extension whose import registers torch ops)."""

    module: str  # e.g. "flashinfer.fused_moe"
    function: str = ""  # a name in the module, or a dotted path to a method: "BatchMLAPagedAttentionWrapper.plan"
    keywords: tuple[str, ...] = ()

    def resolve(self) -> Callable[..., Any]:
        found: Any = importlib.import_module(self.module)
        for name in filter(None, self.function.split(".")):
            found = getattr(found, name)
        return found

    def problem(self) -> Optional[str]:
        """None when the installed function takes every keyword (or its signature cannot be read,
        as for a compiled tvm-ffi function: then only its presence is checked), else what is wrong.
        A torch op (``VendorCall("torch", "ops._moe_C.grouped_topk", ...)``) is probed through its
        registered schema, whose argument names are its keywords."""
        try:
            function = self.resolve()
        except Exception as error:  # noqa: BLE001 - a vendor module may fail in any way
            if not self.function:  # OSError for a missing shared library, ImportError for a symbol
                return f"import {self.module} failed: {type(error).__name__}: {error}"
            return f"{self.module}.{self.function}: {type(error).__name__}: {error}"
        if not self.function:
            return None
        names = _parameter_names(function)
        if names is None:
            _log.debug("kernelmux: %s.%s: no readable signature; keywords not probed", self.module, self.function)
            return None
        missing = [k for k in self.keywords if k not in names]
        if missing:
            return (f"{self.module}.{self.function} takes no keyword {', '.join(missing)} "
                    f"(its parameters: {', '.join(names)})")
        return None


def _parameter_names(function: Any) -> Optional[list[str]]:
    """The keywords ``function`` takes, in order; None when they cannot be read or it takes any
    (``**kwargs``). A torch op's come from its schema (each overload's, for an overload packet)."""
    import torch

    if isinstance(function, torch._ops.OpOverloadPacket):
        overloads = [getattr(function, name) for name in function.overloads()]
        return list(dict.fromkeys(arg.name for op in overloads for arg in op._schema.arguments))
    if isinstance(function, torch._ops.OpOverload):
        return [arg.name for arg in function._schema.arguments]
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return list(parameters)


@dataclass(frozen=True)
class Vendor:
    """A vendor library: its import name, its distribution and the versions kernelmux was tested with,
    ``tested[0] <= version < tested[1]`` (the range its extra pins)."""

    name: str  # the import name, e.g. "flashinfer"
    distribution: str  # e.g. "flashinfer-python"
    tested: tuple[Version, Version]
    extra: str = ""  # kernelmux's extra that installs it (default: the import name)

    @property
    def install_hint(self) -> str:
        return f"pip install 'kernelmux[{self.extra or self.name}]'"

    def version(self) -> Optional[str]:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def problem(self) -> Optional[str]:
        """Why the library cannot serve at all (None when it can): not installed, a version outside
        the tested range, or an exception at import. Asked once per process."""
        with _lock:
            if self not in _problems:
                _problems[self] = self._find_problem()
            return _problems[self]

    def problem_for(self, calls: tuple[VendorCall, ...]) -> Optional[str]:
        """``problem()``, else why one of ``calls`` (the functions one op calls) fails: missing, or
        no longer taking a keyword kernelmux passes. An op's static check: a vendor release that
        changes one API quarantines the ops that call it, not the whole backend."""
        reason = self.problem()
        if reason is not None or not calls:
            return reason
        with _lock:
            if (self, calls) not in _problems:
                found = next((r for r in (call.problem() for call in calls) if r is not None), None)
                _problems[(self, calls)] = None if found is None else f"{self.distribution} {self.version()}: {found}"
            return _problems[(self, calls)]

    def static_check(self, calls: tuple[VendorCall, ...]) -> Callable[[Any], Optional[str]]:
        """The static check of an implementation that makes ``calls``: ``problem_for(calls)``."""
        return lambda platform: self.problem_for(calls)

    def _find_problem(self) -> Optional[str]:
        version = self.version()
        low, high = self.tested
        if version is None:
            return f"{self.distribution} is not installed ({self.install_hint})"
        if not low <= _release(version) < high:
            return (f"{self.distribution} {version} is outside the tested range >={_dotted(low)},<{_dotted(high)} "
                    f"({self.install_hint})")
        try:
            importlib.import_module(self.name)
        except BaseException as error:  # noqa: BLE001 - vendors raise RuntimeError, SystemExit, ...
            if isinstance(error, KeyboardInterrupt):
                raise
            return f"{self.distribution} {version}: import {self.name} failed: {type(error).__name__}: {error}"
        return None

    def module(self) -> ModuleType:
        """The imported library (call only after ``problem()`` said None)."""
        return importlib.import_module(self.name)


_lock = threading.Lock()
_problems: dict[Hashable, Optional[str]] = {}  # Vendor -> problem(); (Vendor, calls) -> problem_for()


class _FirstCalls:
    """The vendor calls that may compile (JIT at first use): each (vendor, op, variant) is logged
    before its first call starts and that call's wall time kept, so a minutes-long compile is
    announced, not mistaken for a hang, and its cost is reported apart from run time."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[str, str, Hashable], float] = {}
        self._lock = threading.Lock()

    def run(self, vendor: Vendor, op: str, variant: Hashable, where: str, call: Callable[[], Any]) -> Any:
        key = (vendor.name, op, variant)
        if key in self._seconds:
            return call()
        with self._lock:  # one thread compiles, the others wait for it
            if key in self._seconds:
                return call()
            _log.warning("kernelmux: %s %s: first call for %s on %s may compile the vendor's kernel (%s)",
                         vendor.name, op, variant, _arch(), where)
            start = time.perf_counter()
            result = call()
            self._seconds[key] = time.perf_counter() - start
            _log.warning("kernelmux: %s %s: first call for %s took %.1f s", vendor.name, op, variant,
                         self._seconds[key])
            return result

    def seconds(self) -> dict[tuple[str, str, Hashable], float]:
        """(vendor, op, variant) -> the first call's wall time in seconds."""
        return dict(self._seconds)


def _arch() -> str:
    """The architecture a first call compiles for: the current device's (sm_90, gfx942, x86_64)."""
    from kernelmux.platforms import detect

    try:
        return detect().arch
    except Exception as error:  # noqa: BLE001 - a log line must not fail the call it announces
        return f"an undetected arch ({type(error).__name__})"


first_calls = _FirstCalls()
