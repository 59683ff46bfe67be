"""The engine: builds the frozen per-op candidate tables at startup and dispatches each call."""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping

import torch

from kernelmux.engine.platform import Platform, detect, simulate
from kernelmux.engine.settings import Settings
from kernelmux.errors import KernelmuxError, NoImplementationError, UnknownOpError
from kernelmux.ops._spec import OpSpec
from kernelmux.registry import Backend, Implementation, Registry

__all__ = [
    "Candidate",
    "Decision",
    "Dispatcher",
    "Engine",
    "FallbackWarning",
    "OpTable",
]

logger = logging.getLogger("kernelmux")


class FallbackWarning(UserWarning):
    """A call ran on the spec's reference because no implementation accepted it."""


@dataclass(frozen=True)
class Candidate:
    """A viable implementation in selection order, with why it sits where it does."""

    impl: Implementation
    preferred: bool


@dataclass(frozen=True)
class OpTable:
    """One op's startup selection: ordered viable candidates and rejected ones with reasons."""

    spec: OpSpec
    candidates: tuple[Candidate, ...]
    rejected: tuple[tuple[Implementation, str], ...]


@dataclass(frozen=True)
class Decision:
    """What one dispatch key resolved to, with every candidate's answer."""

    backend: str  # the chosen backend; Backend.REFERENCE on fallback
    fallback: bool
    answers: tuple[tuple[str, str | None], ...]  # (backend, None if accepted else reason)


def _first_tensor_device(args: Iterable[Any], kwargs: Mapping[str, Any]) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


class Dispatcher:
    """The per-call path of one op: validate, look the key up, run. Everything slow happens once
    per dispatch key, in ``_select``."""

    __slots__ = ("_cache", "_engine", "_lock", "_validate", "decisions", "table")

    def __init__(self, engine: "Engine", table: OpTable) -> None:
        self._engine = engine
        self.table = table
        self._validate = table.spec.validate
        self._cache: dict[Hashable, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.decisions: dict[Hashable, Decision] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._validate(*args, **kwargs)
        fn = self._cache.get(key)
        if fn is None:
            fn = self._select(key, args, kwargs)
        return fn(*args, **kwargs)

    def resolve(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Validate once and return the implementation function this call would run."""
        key = self._validate(*args, **kwargs)
        fn = self._cache.get(key)
        return fn if fn is not None else self._select(key, args, kwargs)

    def answers(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], device_type: str | None = None
    ) -> list[tuple[Implementation, str | None]]:
        """Every candidate's answer to a call, in order (``device_type`` overrides the inputs'
        device, for simulated platforms whose tensors cannot exist here)."""
        device_type = device_type or _first_tensor_device(args, kwargs)
        result = []
        for candidate in self.table.candidates:
            impl = candidate.impl
            reason = None
            if impl.devices and device_type not in impl.devices:
                reason = (
                    f"runs on {'/'.join(sorted(impl.devices))} tensors, the inputs are on {device_type}"
                )
            elif impl.supports is not None:
                try:
                    reason = impl.supports(*args, **kwargs)
                except Exception as error:  # a buggy supports() declines; it must not crash calls
                    reason = f"supports() raised {type(error).__name__}: {error}"
            result.append((impl, reason))
        return result

    def _select(self, key: Hashable, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Callable[..., Any]:
        with self._lock:
            fn = self._cache.get(key)
            if fn is not None:
                return fn
            answers = self.answers(args, kwargs)
            chosen = next((impl for impl, reason in answers if reason is None), None)
            summary = tuple((impl.backend, reason) for impl, reason in answers)
            spec = self.table.spec
            if chosen is not None:
                fn = chosen.fn
                self.decisions[key] = Decision(chosen.backend, False, summary)
            else:
                declined = [(b, r or "") for b, r in summary] + [
                    (impl.backend, f"rejected at startup: {why}")
                    for impl, why in self.table.rejected
                    if impl.backend != Backend.REFERENCE  # the fallback itself is no candidate
                ]
                if self._engine.settings.strict:
                    raise NoImplementationError(spec.name, declined)
                fn = spec.reference
                self.decisions[key] = Decision(Backend.REFERENCE.value, True, summary)
                reasons = "; ".join(f"{b}: {r}" for b, r in declined) or (
                    "no other implementation is registered"
                )
                message = (
                    f"kernelmux: {spec.name} fell back to the reference (slow) for this input "
                    f"({reasons}). Set KERNELMUX_STRICT=1 to make this an error."
                )
                logger.warning(message)
                warnings.warn(message, FallbackWarning, stacklevel=4)
            self._cache[key] = fn
            return fn


class Engine:
    """Startup selection for one platform: detect, load plugins, build frozen per-op tables.

    ``plugins`` (name -> plugin object) are registered after the entry points, for plugins that
    live in a script or notebook rather than an installed distribution.
    """

    def __init__(
        self,
        specs: Iterable[OpSpec],
        settings: Settings | None = None,
        *,
        platform: Platform | None = None,
        registry: Registry | None = None,
        plugins: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        if platform is None:
            platform = simulate(self.settings.platform) if self.settings.platform else detect()
        self.platform = platform
        self.specs = {spec.name: spec for spec in specs}
        if registry is None:
            registry = Registry(self.specs, strict=self.settings.strict)
            registry.load_entry_points(self.settings.allow_plugins)
        for name, plugin in (plugins or {}).items():
            registry.register_plugin(plugin, name)
        self.registry = registry
        self.tables = {name: self._build_table(spec) for name, spec in self.specs.items()}
        self.dispatchers = {name: Dispatcher(self, table) for name, table in self.tables.items()}

    def _build_table(self, spec: OpSpec) -> OpTable:
        preference = self.settings.preference(spec.name)
        viable: list[Implementation] = []
        rejected: list[tuple[Implementation, str]] = []
        for impl in self.registry.for_op(spec.name):
            denial = self.settings.denial(spec.name, impl.backend)
            reason = (
                f"denied by the deny list ({denial!r})" if denial
                else impl.requirement.check(self.platform)
            )
            if reason is None:
                missing = impl.missing_packages()
                if missing:
                    reason = f"missing packages {', '.join(missing)} (pip install {' '.join(missing)})"
            if reason is None and impl.backend == Backend.REFERENCE and Backend.REFERENCE not in preference:
                # The reference is the fallback, never a silent candidate: it runs only when asked
                # for by name or when nothing accepts a call (with a warning).
                reason = "fallback only (prefer it by name to select it)"
            if reason is None:
                viable.append(impl)
            else:
                rejected.append((impl, reason))

        def order(impl: Implementation) -> tuple[int, int, str]:
            rank = preference.index(impl.backend) if impl.backend in preference else len(preference)
            return (rank, -impl.priority, impl.backend)

        viable.sort(key=order)
        candidates = tuple(Candidate(impl, impl.backend in preference) for impl in viable)
        return OpTable(spec, candidates, tuple(rejected))

    def dispatcher(self, op: str) -> Dispatcher:
        try:
            return self.dispatchers[op]
        except KeyError:
            raise UnknownOpError(op, list(self.dispatchers)) from None

    def resolve(self, op: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return self.dispatcher(op).resolve(*args, **kwargs)

    def explain(self, op: str, kwargs: Mapping[str, Any]) -> list[tuple[Implementation, str | None]]:
        """Every candidate's answer to a call with ``kwargs``, without running or caching it."""
        dispatcher = self.dispatcher(op)
        dispatcher.table.spec.validate(**kwargs)
        device_type = self.platform.device_type if self.platform.simulated else None
        return dispatcher.answers((), kwargs, device_type)


def check_known_backends(engine: Engine, names: Iterable[str]) -> None:
    """Raise when preferences name a backend no plugin registered (a typo would otherwise be silent)."""
    known = {impl.backend for impl in engine.registry.implementations.values()}
    unknown = sorted(set(names) - known)
    if unknown:
        raise KernelmuxError(
            f"unknown backend(s) {unknown} in preferences; registered backends: {sorted(known)}"
        )
