"""The engine: builds the frozen per-op candidate tables at startup and dispatches each call."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, NamedTuple

import torch

from kernelmux.engine import fingerprint, tuning
from kernelmux.engine.settings import Settings
from kernelmux.errors import ConfigurationError, ImplementationError, NoImplementationError, UnknownOpError
from kernelmux.platforms import Platform, detect, simulate
from kernelmux.registry import Backend, Implementation, Registry
from kernelmux.specs._spec import OpSpec

__all__ = [
    "Candidate",
    "CheckedDispatcher",
    "Decision",
    "Dispatcher",
    "Engine",
    "FallbackWarning",
    "OpTable",
    "output_problem",
]


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
    platform: str = ""  # the platform the key was decided for (Platform.describe())
    tuned: str = ""  # the tuning table's measurement that ordered the candidates ("" : priorities)
    capture: str = ""  # what runs instead under CUDA-graph capture, and why ("" : the chosen one)


class _Choice(NamedTuple):
    """A dispatch key's cached outcome: the function to run and who provides it, and the choice a
    call captured in a CUDA graph takes instead (None: this one captures)."""

    fn: Callable[..., Any]
    backend: str
    plugin: str
    under_capture: "_Choice | None" = None


def _ask(impl: Implementation, key: Any, platform: Platform, role: str = "supports") -> str | None:
    """``impl.supports(key, platform)`` (or its ``capture_check``), with anything it raises or
    returns amiss as its reason to decline: a buggy plugin function must not crash calls
    (KeyboardInterrupt still propagates)."""
    try:
        reason = getattr(impl, role)(key, platform)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - SystemExit included: a plugin must not end the host
        return f"{role}() raised {type(error).__name__}: {error}"
    if reason is not None and not isinstance(reason, str):
        return f"{role}() returned {reason!r}; it must return None (accept) or a reason string (decline)"
    return reason


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (a build without CUDA raises if asked)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_problem(impl: Implementation, key: Any, platform: Platform) -> str | None:
    """Why a call of ``impl`` with ``key`` cannot be captured in a CUDA graph (None: it can)."""
    return None if impl.capture_check is None else _ask(impl, key, platform, "capture_check")


def output_problem(actual: Any, expected: Any, where: str = "output") -> str | None:
    """How ``actual`` differs from the spec's fake outputs ``expected`` in structure, shape, dtype
    or device (None when it does not): checked mode's conformance check of every call."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"returned {type(actual).__name__} as {where}, the spec returns a tensor"
        got = (tuple(actual.shape), actual.dtype, actual.device)
        want = (tuple(expected.shape), expected.dtype, expected.device)
        if got != want:
            return (f"returned {where} of shape {got[0]}, {got[1]} on {got[2]}; the spec returns shape "
                    f"{want[0]}, {want[1]} on {want[2]}")
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            shape = f"a {type(actual).__name__}" + (f" of {len(actual)}" if isinstance(actual, (tuple, list)) else "")
            return f"returned {shape} as {where}, the spec returns a tuple of {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            problem = output_problem(a, e, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if expected is None and actual is not None:
        return f"returned {type(actual).__name__} as {where}, the spec returns None (an in-place op)"
    return None


_FINGERPRINTS = 4096  # calls remembered per op; past it the memo starts over (a bound, not an LRU)


class Dispatcher:
    """The per-call path of one op: validate, look the key up, run. Everything slow happens once
    per dispatch key, in ``_select``; a call whose arguments' metadata were seen before skips
    validation (engine/fingerprint.py); an implementation that raises is reported as an
    ``ImplementationError`` naming it."""

    __slots__ = ("_cache", "_decisions", "_engine", "_fingerprint", "_known", "_lock", "_reference", "_validate",
                 "table")

    def __init__(self, engine: "Engine", table: OpTable) -> None:
        self._engine = engine
        self.table = table
        # The reference as a candidate a tuning table can rank first (it is fallback-only otherwise):
        # the reference backend's record, or the spec's function where that backend is not loaded.
        self._reference = next((impl for impl, _ in table.rejected if impl.backend == Backend.REFERENCE), None) \
            or Implementation(op=table.spec.name, backend=Backend.REFERENCE, fn=table.spec.reference,
                              spec_version=table.spec.version, priority=-1000,
                              description="the spec's pure-torch reference (fp32 math); the fallback")
        self._validate = table.spec.validate
        self._fingerprint = engine.fingerprint
        self._cache: dict[Hashable, _Choice] = {}
        self._known: dict[Hashable, _Choice] = {}  # fingerprint -> the choice its key resolved to
        self._lock = threading.Lock()
        self._decisions: dict[Hashable, Decision] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        seen = self._fingerprint(args, kwargs)
        choice = self._known.get(seen) if seen is not None else None
        if choice is None:
            key = self._validate(*args, **kwargs)
            choice = self._cache.get(key)
            if choice is None:
                choice = self._select(key)
            if seen is not None:
                if len(self._known) >= _FINGERPRINTS:
                    self._known.clear()
                self._known[seen] = choice
        if choice.under_capture is not None and _capturing():
            choice = choice.under_capture  # asked only where the choice cannot be captured itself
        try:
            return choice.fn(*args, **kwargs)
        except Exception as error:
            failure = self._failure(choice, error)
            if failure is error:
                raise
            raise failure from error

    def resolve(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Validate once and return the implementation function this call would run (called
        directly, it is not wrapped: what it raises reaches the caller as is). Resolved while a
        CUDA graph is being captured, it is the function that can be captured."""
        key = self._validate(*args, **kwargs)
        choice = self._cache.get(key)
        if choice is None:
            choice = self._select(key)
        if choice.under_capture is not None and _capturing():
            choice = choice.under_capture
        return choice.fn

    @property
    def decisions(self) -> dict[Hashable, Decision]:
        """A snapshot of every dispatch key decided so far (safe while other threads dispatch)."""
        with self._lock:
            return dict(self._decisions)

    def answers(self, key: Any, platform: Platform) -> list[tuple[Implementation, str | None]]:
        """Every candidate's answer to a call with dispatch ``key`` on ``platform``, in order."""
        engine = self._engine
        device_type = key.device.type
        result = []
        for candidate in self.table.candidates:
            impl = candidate.impl
            reason = None
            if impl.devices and device_type not in impl.devices:
                reason = f"runs on {'/'.join(sorted(impl.devices))} tensors, the inputs are on {device_type}"
            elif platform is not engine.platform:
                reason = engine.platform_problem(impl, platform)
            if reason is None and impl.supports is not None:
                reason = _ask(impl, key, platform)
            result.append((impl, reason))
        return result

    def measured(self, key: Any, platform: Platform) -> tuple[tuning.Measurement, bool] | None:
        """The tuning tables' measurement for ``key`` and whether it is the key's own bucket; None
        where no table applies (another device than the one measured, or no bucket like it)."""
        if platform is not self._engine.platform:
            return None
        return self._engine.tuning.lookup(self.table.spec.name, key)

    def ordered_answers(self, key: Any, platform: Platform
                        ) -> tuple[list[tuple[Implementation, str | None]], str]:
        """``answers`` in the order a call tries them, and the measurement behind it ("" when the
        priorities decide): preferred backends first, then the tuning table's ranking for the key's
        bucket (the reference where it ranked, accepting every call), then the unmeasured rest."""
        answers = self.answers(key, platform)
        found = self.measured(key, platform)
        if found is None:
            return answers, ""
        measurement, exact = found
        times = measurement.times_us
        preferred = [(impl, r) for (impl, r), c in zip(answers, self.table.candidates) if c.preferred]
        rest = [(impl, r) for (impl, r), c in zip(answers, self.table.candidates) if not c.preferred]
        if Backend.REFERENCE in times and all(impl.backend != Backend.REFERENCE for impl, _ in answers):
            rest.append((self._reference, None))
        # Fastest first; those within TIE of the fastest keep priority order (the reference last): a
        # difference the timer cannot tell from noise does not override the priorities.
        measured = [a for a in rest if a[0].backend in times]
        limit = min((times[a[0].backend] for a in measured), default=0.0) * (1 + tuning.TIE)
        tied = sorted((a for a in measured if times[a[0].backend] <= limit),
                      key=lambda a: a[0].backend == Backend.REFERENCE)  # stable: priority order
        slower = sorted((a for a in measured if times[a[0].backend] > limit), key=lambda a: times[a[0].backend])
        unmeasured = [a for a in rest if a[0].backend not in times]
        return preferred + tied + slower + unmeasured, measurement.describe(exact)

    @staticmethod
    def capture_plan(answers: list[tuple[Implementation, str | None]], key: Any, platform: Platform
                     ) -> tuple[Implementation | None, str]:
        """Where the first implementation of ``answers`` that accepts cannot be captured in a CUDA
        graph: the next one that accepts and can be (None: none can), and what to report; else
        ``(None, "")``."""
        accepting = [impl for impl, reason in answers if reason is None]
        why = capture_problem(accepting[0], key, platform) if accepting else None
        if why is None:
            return None, ""
        instead = next((impl for impl in accepting[1:] if capture_problem(impl, key, platform) is None), None)
        return instead, (f"under CUDA-graph capture {instead.backend if instead else 'still ' + accepting[0].backend}"
                         f" ({accepting[0].backend} cannot be captured: {why})")

    def _select(self, key: Hashable) -> _Choice:
        with self._lock:
            choice = self._cache.get(key)
            if choice is not None:
                return choice
            platform = self._engine.platform_for(key.device)  # type: ignore[attr-defined]
            answers, tuned = self.ordered_answers(key, platform)
            chosen = next((impl for impl, reason in answers if reason is None), None)
            summary = tuple((impl.backend, reason) for impl, reason in answers)
            spec = self.table.spec
            if chosen is not None:
                instead, capture = self.capture_plan(answers, key, platform)
                choice = _Choice(chosen.fn, chosen.backend, chosen.plugin,
                                 _Choice(instead.fn, instead.backend, instead.plugin) if instead else None)
                self._decisions[key] = Decision(chosen.backend, False, summary, platform.describe(), tuned, capture)
            else:
                declined = [(b, r or "") for b, r in summary] + [
                    (impl.backend, f"rejected at startup: {why}")
                    for impl, why in self.table.rejected
                    if impl.backend != Backend.REFERENCE  # the fallback itself is no candidate
                ]
                if self._engine.settings.strict:
                    raise NoImplementationError(spec.name, declined)
                choice = _Choice(spec.reference, Backend.REFERENCE.value, Backend.REFERENCE.value)
                self._decisions[key] = Decision(Backend.REFERENCE.value, True, summary, platform.describe())
                reasons = "; ".join(f"{b}: {r}" for b, r in declined) or "no other implementation is registered"
                # One channel only (a warning, which logging.captureWarnings can route): a log
                # record beside it printed every fallback twice.
                warnings.warn(
                    f"kernelmux: {spec.name} fell back to the reference (slow) for this input ({reasons}). "
                    "Set KERNELMUX_STRICT=1 to make this an error.",
                    FallbackWarning, stacklevel=4,
                )
            self._cache[key] = choice
            return choice

    def _failure(self, choice: _Choice, error: Exception) -> Exception:
        """The ImplementationError reporting ``error``, raised by ``choice``'s function. Running
        out of memory is the machine's state, not the implementation's fault: callers catch it
        by its type, so it passes through, named in a note."""
        if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
            if hasattr(error, "add_note"):
                error.add_note(f"(in {self.table.spec.name}:{choice.backend}, plugin {choice.plugin!r})")
            return error
        return ImplementationError(
            self.table.spec.name, choice.backend, choice.plugin, self._engine.distribution(choice.plugin),
            f"raised {type(error).__name__}: {error}",
        )


class CheckedDispatcher(Dispatcher):
    """Checked mode (``KERNELMUX_CHECK=1``, ``configure(check=True)``): before a call, the
    spec's ``check_data`` validates the contents of its index tensors (one device pass and one
    sync); after it, the outputs' structure, shapes, dtypes and devices are compared with the
    spec's fake. For debugging an integration, not for serving: each call costs a host sync."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._validate(*args, **kwargs)  # bad metadata is reported before the data is read
        spec = self.table.spec
        if spec.check_data is not None:
            spec.check_data(*args, **kwargs)
        result = super().__call__(*args, **kwargs)  # validates again: noise beside the sync
        problem = output_problem(result, spec.fake(*args, **kwargs))
        if problem is not None:
            choice = self._cache[key]
            raise ImplementationError(spec.name, choice.backend, choice.plugin,
                                      self._engine.distribution(choice.plugin), problem)
        return result


class Engine:
    """Startup selection for one platform: detect, load plugins, check the settings against
    what loaded, build frozen per-op tables.

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
        self._check_settings()
        self._platforms: dict[torch.device, Platform] = {}
        self._platform_lock = threading.Lock()
        self.tables = {name: self._build_table(spec) for name, spec in self.specs.items()}
        self.tuning = tuning.load(self.platform, self.registry, enabled=self.settings.tuning)
        # Native where it is built (kernelmux warmup), else Python: the same meaning, one per engine.
        self.fingerprint = fingerprint.active() if self.settings.native_fingerprint else fingerprint.python_fingerprint
        dispatcher = CheckedDispatcher if self.settings.check else Dispatcher
        self.dispatchers = {name: dispatcher(self, table) for name, table in self.tables.items()}

    def _check_settings(self) -> None:
        """Every op, backend and plugin the settings name exists: a typo in an environment
        variable or a configure() argument is an error listing the known names, never ignored."""
        settings, registry = self.settings, self.registry
        ops = set(self.specs)
        backends = {impl.backend for impl in registry.implementations.values()} | {b.value for b in Backend}
        problems = []
        for op, names in settings.prefer.items():
            if op != "*" and op not in ops:
                problems.append(f"prefer names unknown op {op!r}")
            problems += [f"prefer names unknown backend {b!r} (for {op})" for b in names if b not in backends]
        for entry in sorted(settings.deny):
            op, _, backend = entry.rpartition(":")
            if op and op not in ops:
                problems.append(f"deny names unknown op {op!r} (in {entry!r})")
            if backend not in backends:
                problems.append(f"deny names unknown backend {backend!r}" + (f" (in {entry!r})" if op else ""))
        if settings.allow_plugins is not None:
            discovered = {p.name for p in (*registry.plugins, *registry.skipped, *registry.quarantined)}
            problems += [f"the plugin allow-list names {name!r}, which no installed distribution provides"
                         for name in sorted(settings.allow_plugins - discovered)]
            known_plugins = f"; plugins: {', '.join(sorted(discovered))}"
        else:
            known_plugins = ""
        if problems:
            raise ConfigurationError(
                "kernelmux settings (KERNELMUX_PREFER / KERNELMUX_DENY / KERNELMUX_PLUGINS or "
                f"configure()): {'; '.join(problems)}. Known ops: {', '.join(sorted(ops))}; backends: "
                f"{', '.join(sorted(backends))}{known_plugins}"
            )

    def platform_problem(self, impl: Implementation, platform: Platform) -> str | None:
        """Why ``impl`` cannot run on ``platform`` (requirement, static check), or None; what its
        static check raises is its reason."""
        try:
            return impl.platform_problem(platform)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - a plugin's check must not end the host
            return f"static_check() raised {type(error).__name__}: {error}"

    def _build_table(self, spec: OpSpec) -> OpTable:
        preference = self.settings.preference(spec.name)
        viable: list[Implementation] = []
        rejected: list[tuple[Implementation, str]] = []
        for impl in self.registry.for_op(spec.name):
            denial = self.settings.denial(spec.name, impl.backend)
            reason = f"denied by the deny list ({denial!r})" if denial else None
            if reason is None:
                missing = impl.missing_packages()
                if missing:
                    reason = f"missing packages {', '.join(missing)} (pip install {' '.join(missing)})"
            if reason is None:
                reason = self.platform_problem(impl, self.platform)
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

    def platform_for(self, device: torch.device) -> Platform:
        """The platform of ``device``: the startup one for its device (and for every device when
        simulating), else detected once per device (a host with GPUs of two archs, or CPU
        tensors on a GPU host)."""
        if self.platform.simulated or device == self.platform.device:
            return self.platform
        platform = self._platforms.get(device)
        if platform is None:
            with self._platform_lock:
                platform = self._platforms.get(device) or detect(device)
                self._platforms[device] = platform
        return platform

    def distribution(self, plugin: str) -> str:
        """``distribution version`` of the plugin named ``plugin``, or "" when not installed."""
        info = next((p for p in self.registry.plugins if p.name == plugin), None)
        if info is None or info.distribution in ("", "?", "(api)"):
            return ""
        return f"{info.distribution} {info.version}".strip()

    def dispatcher(self, op: str) -> Dispatcher:
        try:
            return self.dispatchers[op]
        except KeyError:
            raise UnknownOpError(op, list(self.dispatchers)) from None

    def resolve(self, op: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return self.dispatcher(op).resolve(*args, **kwargs)

    def explain(self, op: str, kwargs: Mapping[str, Any]) -> list[tuple[Implementation, str | None]]:
        """Every candidate's answer to a call with ``kwargs`` in the order the call tries them (the
        first that accepts runs), without running or caching it. On a simulated platform the inputs
        live on this machine but the key says they are on the simulated device: implementations
        decide from the key and the platform alone, so the answer is the one the real machine gives."""
        return self.explain_tuned(op, kwargs)[0]

    def explain_tuned(self, op: str, kwargs: Mapping[str, Any]
                      ) -> tuple[list[tuple[Implementation, str | None]], str]:
        """``explain``, and the tuning table's measurement that ordered it ("" : the priorities)."""
        dispatcher, key, platform = self._explained(op, kwargs)
        return dispatcher.ordered_answers(key, platform)

    def explain_plans(self, op: str, kwargs: Mapping[str, Any]) -> dict[str, str]:
        """What each candidate that accepts a call with ``kwargs`` and describes itself would run (its
        launch configuration and where that comes from), by backend."""
        dispatcher, key, platform = self._explained(op, kwargs)
        return {impl.backend: impl.describe(key, platform)
                for impl, reason in dispatcher.ordered_answers(key, platform)[0]
                if reason is None and impl.describe is not None}

    def explain_capture(self, op: str, kwargs: Mapping[str, Any]) -> str:
        """What a call with ``kwargs`` runs instead under CUDA-graph capture, and why ("" : the same)."""
        dispatcher, key, platform = self._explained(op, kwargs)
        return dispatcher.capture_plan(dispatcher.ordered_answers(key, platform)[0], key, platform)[1]

    def _explained(self, op: str, kwargs: Mapping[str, Any]) -> tuple[Dispatcher, Any, Platform]:
        """The dispatcher, key and platform ``explain`` asks about. On a simulated platform the
        inputs live on this machine but the key says they are on the simulated device."""
        dispatcher = self.dispatcher(op)
        key = dispatcher.table.spec.validate(**kwargs)
        if self.platform.simulated:
            key = key._replace(device=self.platform.device)
        return dispatcher, key, self.platform_for(key.device)
