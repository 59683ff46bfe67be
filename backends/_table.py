"""How every built-in backend registers: one table of ``Entry`` rows, one per op, turned into
``Implementation`` records by ``implementations``. An op's entry module is
``backends/<backend>/<op>.py``, holding the function named after the op and, where the backend
declines some calls, ``supports(key, platform)`` (and ``capture_check(key, platform)`` where some
calls cannot be captured in a CUDA graph, ``describe(key, platform)`` where explain should say which
launch configuration a call runs); it is imported when the backend's hook runs at
engine startup, never when kernelmux itself is imported. A ``Gap`` row names an op the backend's
library has no kernel for, and why, so `kernelmux explain` says it instead of saying nothing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

from kernelmux.errors import ImplementationError
from kernelmux.registry import Implementation, JitCache, PlatformRequirement, StaticCheckFn
from kernelmux.specs import ALL_SPECS

__all__ = ["Defaults", "Entry", "Gap", "implementations"]

_SPECS = {spec.name: spec for spec in ALL_SPECS}


@dataclass(frozen=True)
class Defaults:
    """What every implementation of one backend shares; an ``Entry`` may replace any field."""

    priority: int = 0
    requirement: PlatformRequirement = PlatformRequirement()
    devices: frozenset[str] = frozenset()
    packages: tuple[str, ...] = ()
    static_check: Optional[StaticCheckFn] = None
    jit: Optional[JitCache] = None


@dataclass(frozen=True)
class Entry:
    """One op on one backend: the op's name (its spec's ``NAME`` and its entry module's name), what
    the implementation does in one line, and the fields of ``Defaults`` it sets otherwise."""

    op: str
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in _SPECS:
            raise ValueError(f"Entry op {self.op!r}: no such spec; known: {', '.join(_SPECS)}")
        unknown = set(self.overrides) - set(Defaults.__dataclass_fields__)
        if unknown:
            raise ValueError(f"Entry {self.op!r} overrides {sorted(unknown)}; "
                             f"expected fields of Defaults: {', '.join(Defaults.__dataclass_fields__)}")


@dataclass(frozen=True)
class Gap:
    """An op the backend does not serve on any platform, and why (the library has no such kernel).
    It registers as an implementation whose static check is that reason, so on the backend's
    platforms `kernelmux info` and `explain` list it as not viable, with the reason; it never runs."""

    op: str
    reason: str

    def __post_init__(self) -> None:
        if self.op not in _SPECS:
            raise ValueError(f"Gap op {self.op!r}: no such spec; known: {', '.join(_SPECS)}")


def _never_runs(backend: str, gap: Gap) -> Callable[..., Any]:
    """A function with the op's signature that raises: a Gap's static check rejects it everywhere."""
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise ImplementationError(gap.op, backend, backend, "kernelmux", f"has no kernel for it: {gap.reason}")

    absent.__signature__ = _SPECS[gap.op].signature  # type: ignore[attr-defined]
    return absent


def implementations(backend: str, package: str, defaults: Defaults,
                    table: Iterable[Union[Entry, Gap]]) -> list[Implementation]:
    """The ``Implementation`` of every row of ``table``, for ``backend`` whose entry modules are
    ``<package>.<op>`` (the backend's ``__name__``)."""
    records = []
    for entry in table:
        if isinstance(entry, Gap):
            reason = f"no kernel for {entry.op}: {entry.reason}"
            records.append(Implementation(
                op=entry.op, backend=backend, fn=_never_runs(backend, entry), spec_version=_SPECS[entry.op].version,
                description=f"none: {entry.reason}", requirement=defaults.requirement, devices=defaults.devices,
                static_check=lambda platform, reason=reason: reason,
            ))
            continue
        module = importlib.import_module(f"{package}.{entry.op}")
        fields = {**defaults.__dict__, **entry.overrides}
        records.append(Implementation(
            op=entry.op,
            backend=backend,
            fn=getattr(module, entry.op),
            supports=getattr(module, "supports", None),
            capture_check=getattr(module, "capture_check", None),
            describe=getattr(module, "describe", None),
            spec_version=_SPECS[entry.op].version,
            description=entry.description,
            **fields,
        ))
    return records
