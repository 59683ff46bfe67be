"""The registry: loads plugins through entry points, checks each implementation against its spec,
and quarantines what fails instead of failing the process (unless strict)."""

from __future__ import annotations

import importlib.metadata
import inspect
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import pluggy

from kernelmux.errors import PluginLoadError, RegistrationError
from kernelmux.registry import _hookspecs
from kernelmux.registry._implementation import Implementation

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "QuarantinedPlugin",
    "Registry",
    "Rejection",
    "signature_difference",
]

ENTRY_POINT_GROUP = "kernelmux.backends"


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


@dataclass(frozen=True)
class QuarantinedPlugin:
    name: str
    distribution: str
    version: str
    reason: str


@dataclass(frozen=True)
class Rejection:
    """An implementation refused at registration, and why."""

    plugin: str
    op: str
    backend: str
    reason: str


def _resolved_signature(fn: Any) -> inspect.Signature:
    # eval_str resolves string annotations written under `from __future__ import annotations`.
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, TypeError):
        return inspect.signature(fn)


def signature_difference(expected: inspect.Signature, fn: Any) -> str | None:
    """None when ``fn`` has exactly the ``expected`` parameters (names, kinds, defaults,
    annotations) and return annotation; else the first difference, in words."""
    actual = _resolved_signature(fn)
    want, got = list(expected.parameters.values()), list(actual.parameters.values())
    for index, (w, g) in enumerate(zip(want, got)):
        if w.name != g.name:
            return f"parameter {index} is named {g.name!r}, the spec names it {w.name!r}"
        if w.kind != g.kind:
            return f"parameter {w.name!r} is {g.kind.description}, the spec has {w.kind.description}"
        if w.default != g.default:
            return f"parameter {w.name!r} defaults to {g.default!r}, the spec's default is {w.default!r}"
        if w.annotation != g.annotation:
            return f"parameter {w.name!r} is annotated {g.annotation!r}, the spec has {w.annotation!r}"
    if len(got) != len(want):
        names = [p.name for p in (got[len(want):] or want[len(got):])]
        extra = "extra" if len(got) > len(want) else "missing"
        return f"{extra} parameters {names}"
    if expected.return_annotation != actual.return_annotation:
        return (
            f"returns {actual.return_annotation!r}, the spec returns {expected.return_annotation!r}"
        )
    return None


def _supports_difference(expected: inspect.Signature, fn: Any) -> str | None:
    """supports() must accept the spec's parameters by name (annotations are not compared)."""
    parameters = _resolved_signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) and any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()
    ):
        return None
    if list(parameters) != list(expected.parameters):
        return f"supports() parameters {list(parameters)} differ from the spec's {list(expected.parameters)}"
    return None


class Registry:
    """Every implementation known to this process, keyed by (op, backend), with what was refused."""

    def __init__(self, specs: Mapping[str, Any], *, strict: bool = False) -> None:
        self.specs = dict(specs)
        self.strict = strict
        self.manager = pluggy.PluginManager(_hookspecs.PROJECT)
        self.manager.add_hookspecs(_hookspecs)
        self.implementations: dict[tuple[str, str], Implementation] = {}
        self.plugins: list[PluginInfo] = []
        self.quarantined: list[QuarantinedPlugin] = []
        self.rejections: list[Rejection] = []
        self.skipped: list[PluginInfo] = []  # discovered but not in the allow-list

    # -- loading ------------------------------------------------------------------------------

    def load_entry_points(self, allow: Iterable[str] | None = None) -> None:
        """Load every plugin of the ``kernelmux.backends`` group (built-ins included), or only the
        names in ``allow`` when it is given."""
        allowed = set(allow) if allow is not None else None
        entry_points = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name
        )
        seen: set[str] = set()
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            distribution = dist.name if dist is not None else "?"
            version = dist.version if dist is not None else "?"
            if ep.name in seen:
                # The same distribution visible twice on sys.path (an editable install beside a
                # regular one) would otherwise register everything twice.
                continue
            seen.add(ep.name)
            if allowed is not None and ep.name not in allowed:
                self.skipped.append(PluginInfo(ep.name, distribution, version, ep.value))
                continue
            try:
                module = ep.load()
            except Exception as error:  # a broken plugin must not take the process down
                self._quarantine(ep.name, distribution, version, f"import failed: {_summary(error)}")
                continue
            self.register_plugin(module, ep.name, distribution=distribution, version=version)

    def register_plugin(
        self, plugin: Any, name: str, *, distribution: str = "(api)", version: str = ""
    ) -> None:
        """Register a plugin object (a module or any object with hookimpls) and its implementations."""
        try:
            self.manager.register(plugin, name=name)
            records = []
            for hook in self.manager.hook.kernelmux_implementations.get_hookimpls():
                if hook.plugin_name == name:
                    records.extend(hook.function())
        except Exception as error:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            self._quarantine(name, distribution, version, f"registration failed: {_summary(error)}")
            return
        module = getattr(plugin, "__name__", type(plugin).__name__)
        self.plugins.append(PluginInfo(name, distribution, version, module))
        for record in records:
            self.add(record, plugin=name)

    def add(self, impl: Implementation, *, plugin: str = "(api)") -> None:
        """Check ``impl`` against its spec and keep it, or record (strict: raise) the rejection."""
        try:
            self._check(impl, plugin)
        except RegistrationError as error:
            if self.strict:
                raise
            self.rejections.append(Rejection(plugin, error.op, error.backend, error.problem))
            return
        object.__setattr__(impl, "plugin", plugin)
        self.implementations[(impl.op, impl.backend)] = impl

    def _check(self, impl: Any, plugin: str) -> None:
        if not isinstance(impl, Implementation):
            raise RegistrationError(
                plugin, "?", "?", f"returned {type(impl).__name__}, expected kernelmux Implementation"
            )
        spec = self.specs.get(impl.op)
        if spec is None:
            raise RegistrationError(
                plugin, impl.op, impl.backend, f"no spec named {impl.op!r}; specs: {', '.join(sorted(self.specs))}"
            )
        existing = self.implementations.get((impl.op, impl.backend))
        if existing is not None:
            raise RegistrationError(
                plugin, impl.op, impl.backend,
                f"duplicate: {impl.key} is already registered by plugin {existing.plugin!r}",
            )
        if impl.spec_version != spec.version:
            raise RegistrationError(
                plugin, impl.op, impl.backend,
                f"implements spec version {impl.spec_version}, the installed spec is version {spec.version}",
            )
        difference = signature_difference(spec.signature, impl.fn)
        if difference:
            raise RegistrationError(plugin, impl.op, impl.backend, f"signature differs: {difference}")
        if impl.supports is not None:
            difference = _supports_difference(spec.signature, impl.supports)
            if difference:
                raise RegistrationError(plugin, impl.op, impl.backend, difference)

    def _quarantine(self, name: str, distribution: str, version: str, reason: str) -> None:
        if self.strict:
            raise PluginLoadError(name, distribution, reason)
        self.quarantined.append(QuarantinedPlugin(name, distribution, version, reason))

    # -- queries ------------------------------------------------------------------------------

    def for_op(self, op: str) -> list[Implementation]:
        return [impl for (name, _), impl in self.implementations.items() if name == op]


def _summary(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}: {error}{where}"
