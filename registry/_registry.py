"""The registry: loads plugins through entry points, checks each implementation against its spec,
and quarantines what fails or claims a name it does not own instead of failing the process (unless
strict)."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import traceback
from dataclasses import dataclass
from typing import Any, Final, Iterable, Mapping

import pluggy

from kernelmux.errors import PluginConflictError, PluginLoadError, RegistrationError
from kernelmux.registry import _hookspecs
from kernelmux.registry._implementation import Backend, Implementation

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "QuarantinedPlugin",
    "RESERVED_NAMES",
    "Registry",
    "Rejection",
    "builtin_module",
    "signature_difference",
]

ENTRY_POINT_GROUP: Final = "kernelmux.backends"
# Plugin and backend names only kernelmux's own backends may use: otherwise an installed package
# could take over "cpu" (and every preference or deny list naming it) by registering it first.
RESERVED_NAMES: Final[frozenset[str]] = frozenset(backend.value for backend in Backend)
_BUILTIN_PACKAGE: Final = "kernelmux.backends"
_HOOK: Final = _hookspecs.kernelmux_implementations.__name__


def builtin_module(name: str) -> str:
    """The module of the built-in plugin that owns the reserved ``name``: the value its entry
    point must have (``cpu = "kernelmux.backends.cpu"``)."""
    return f"{_BUILTIN_PACKAGE}.{name}"


@dataclass(frozen=True)
class PluginInfo:
    """A plugin: its name, the distribution that ships it, its module, and how many
    implementations it registered (0 for one discovered but not loaded)."""

    name: str
    distribution: str
    version: str
    module: str
    implementations: int = 0


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


@dataclass(frozen=True)
class _Claim:
    """One entry point of the group and the distribution that declares it."""

    entry_point: importlib.metadata.EntryPoint
    distribution: str
    version: str

    @property
    def builtin(self) -> bool:
        name = self.entry_point.name
        return name in RESERVED_NAMES and self.entry_point.value == builtin_module(name)


class _Refused(Exception):
    """A plugin that registered without error but cannot work; the message is the reason."""


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


def _supports_difference(spec: Any, fn: Any) -> str | None:
    """supports() is called as ``supports(key, platform)``: it must take exactly those two
    positional arguments. The spec's own parameters are refused with the fix: a supports()
    reading the call's arguments would decide on what the cached key does not hold."""
    try:
        parameters = list(_resolved_signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or extension callable without a signature: trust the call
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    keyword_only = [p for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) <= 2 and (len(positional) >= 2 or varargs) and not keyword_only:
        return None
    return (
        f"supports() takes {[p.name for p in parameters]}; it must take (key, platform): the spec's "
        f"dispatch key ({spec.key.__module__}.{spec.key.__qualname__}: {', '.join(spec.key._fields)}) and "
        "the call's Platform, and decide from them alone"
    )


class Registry:
    """Every implementation known to this process, keyed by (op, backend), with what was refused.

    Names are owned: a reserved name (a ``Backend`` value) only by the built-in plugin whose entry
    point is ``kernelmux.backends.<name>``, a plugin name by one distribution, a backend name by the
    first plugin that registers it. Any other claim is quarantined or rejected, and reported.
    """

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
        self._builtins: set[str] = set()  # plugins loaded from their built-in entry point
        self._distributions: dict[str, str] = {}  # plugin name -> the distribution that shipped it
        self._backend_owners: dict[str, str] = {}  # backend name -> the plugin that registered it first

    # -- loading ------------------------------------------------------------------------------

    def load_entry_points(self, allow: Iterable[str] | None = None) -> None:
        """Load every plugin of the ``kernelmux.backends`` group (built-ins included), or only the
        names in ``allow`` when it is given. An entry point whose name is reserved or also declared
        by another distribution is quarantined without being imported."""
        allowed = set(allow) if allow is not None else None
        for name, claims in _discover().items():
            if allowed is not None and name not in allowed:
                self.skipped.extend(
                    PluginInfo(name, c.distribution, c.version, c.entry_point.value) for c in claims
                )
                continue
            claim = self._settle(name, claims)
            if claim is not None:
                self._load(claim)

    def _settle(self, name: str, claims: list[_Claim]) -> _Claim | None:
        """The one claim allowed to load ``name``, after quarantining every other (or None)."""
        if name in RESERVED_NAMES:
            winner = next((c for c in claims if c.builtin), None)
            for claim in claims:
                if claim is not winner:
                    self._quarantine(
                        PluginConflictError(name, claim.distribution, _reserved_entry_point(claim)),
                        claim.version,
                    )
            return winner
        if len(claims) == 1:
            return claims[0]
        # The order of distributions on sys.path is an accident of installation, so neither wins.
        for claim in claims:
            others = ", ".join(f"{o.distribution} {o.version}" for o in claims if o is not claim)
            problem = (
                f"the entry-point name {name!r} is also declared by {others}; a plugin name belongs "
                f"to one distribution, so none of them was loaded (fix: uninstall one, or rename "
                f"the entry point under [project.entry-points.\"{ENTRY_POINT_GROUP}\"] in one)"
            )
            self._quarantine(PluginConflictError(name, claim.distribution, problem), claim.version)
        return None

    def _load(self, claim: _Claim) -> None:
        ep = claim.entry_point
        try:
            module = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit too: a broken plugin must not end the process
            problem = _failure("import failed", error)
            self._quarantine(PluginLoadError(ep.name, claim.distribution, problem), claim.version, error)
            return
        self._register(module, ep.name, claim.distribution, claim.version, builtin=claim.builtin)

    def register_plugin(
        self, plugin: Any, name: str, *, distribution: str = "(api)", version: str = ""
    ) -> None:
        """Register a plugin object (a module or any object with hookimpls) and its implementations.
        A reserved name (a built-in backend's) is refused: quarantined, or raised in strict mode."""
        if name in RESERVED_NAMES:
            problem = (
                f"the plugin name {name!r} is reserved for kernelmux's built-in {name} backend "
                f"({builtin_module(name)}); reserved names: {', '.join(sorted(RESERVED_NAMES))} "
                f"(fix: register it under a name of its own, and give its implementations a "
                f"backend name of their own)"
            )
            self._quarantine(PluginConflictError(name, distribution, problem), version)
            return
        self._register(plugin, name, distribution, version, builtin=False)

    def _register(
        self, plugin: Any, name: str, distribution: str, version: str, *, builtin: bool
    ) -> None:
        # pluggy refuses an object registered twice, and undoing that refusal must not unregister
        # the first registration: only what this call registered is undone.
        was_registered = True
        try:
            was_registered = self.manager.is_registered(plugin)
            self.manager.register(plugin, name=name)
            records = self._records(plugin, name)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit too: plugin code runs in both calls above
            if not was_registered and self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            problem = str(error) if isinstance(error, _Refused) else _failure("registration failed", error)
            self._quarantine(PluginLoadError(name, distribution, problem), version, error)
            return
        if builtin:
            self._builtins.add(name)
        self._distributions[name] = distribution
        accepted = sum(self._add(record, name) for record in records)
        module = getattr(plugin, "__name__", type(plugin).__name__)
        self.plugins.append(PluginInfo(name, distribution, version, module, accepted))

    def _records(self, plugin: Any, name: str) -> list[Any]:
        """What the registered plugin's hook returns; _Refused when it has no usable hook."""
        hooks = [h for h in getattr(self.manager.hook, _HOOK).get_hookimpls() if h.plugin_name == name]
        if not hooks and callable(getattr(plugin, _HOOK, None)):
            # pluggy ignores an undecorated function: the plugin would load and contribute nothing.
            raise _Refused(
                f"defines {_HOOK} without @kernelmux.hookimpl, so nothing was registered (fix: "
                f"`from kernelmux import hookimpl` and put @hookimpl above `def {_HOOK}`)"
            )
        # A decorated function with a misspelt hook name would be ignored the same way.
        self.manager.check_pending()
        return [record for hook in hooks for record in hook.function()]

    def add(self, impl: Implementation, *, plugin: str = "(api)") -> None:
        """Check ``impl`` against its spec and keep it, or record (strict: raise) the rejection."""
        self._add(impl, plugin)

    def _add(self, impl: Any, plugin: str) -> bool:
        """As ``add``; True when ``impl`` was kept."""
        try:
            self._check(impl, plugin)
        except RegistrationError as error:
            if self.strict:
                raise
            self.rejections.append(Rejection(plugin, error.op, error.backend, error.problem))
            return False
        object.__setattr__(impl, "plugin", plugin)
        self.implementations[(impl.op, impl.backend)] = impl
        self._backend_owners.setdefault(impl.backend, plugin)
        return True

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
        if impl.backend in RESERVED_NAMES and not (plugin == impl.backend and plugin in self._builtins):
            raise RegistrationError(
                plugin, impl.op, impl.backend,
                f"the backend name {impl.backend!r} is reserved for kernelmux's built-in "
                f"{impl.backend} backend ({builtin_module(impl.backend)}); plugin {plugin!r} (from "
                f"{self._distribution(plugin)}) may not register it (fix: give the implementation a "
                f"backend name of its own; reserved: {', '.join(sorted(RESERVED_NAMES))})",
            )
        existing = self.implementations.get((impl.op, impl.backend))
        if existing is not None:
            raise RegistrationError(
                plugin, impl.op, impl.backend,
                f"duplicate: {impl.key} is already registered by plugin {existing.plugin!r}",
            )
        owner = self._backend_owners.get(impl.backend)
        if owner is not None and owner != plugin:
            # One owner per backend name, so a preference or deny list naming it means one plugin.
            raise RegistrationError(
                plugin, impl.op, impl.backend,
                f"the backend name {impl.backend!r} belongs to plugin {owner!r} (from "
                f"{self._distribution(owner)}), which registered it first; plugin {plugin!r} (from "
                f"{self._distribution(plugin)}) may not use it too (fix: give the implementation "
                f"a backend name of its own)",
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
            difference = _supports_difference(spec, impl.supports)
            if difference:
                raise RegistrationError(plugin, impl.op, impl.backend, difference)

    def _distribution(self, plugin: str) -> str:
        return self._distributions.get(plugin, "(api)")

    def _quarantine(
        self, error: PluginLoadError, version: str, cause: BaseException | None = None
    ) -> None:
        if self.strict:
            raise error from cause
        self.quarantined.append(QuarantinedPlugin(error.plugin, error.distribution, version, error.problem))

    # -- queries ------------------------------------------------------------------------------

    def for_op(self, op: str) -> list[Implementation]:
        return [impl for (name, _), impl in self.implementations.items() if name == op]


def _discover() -> dict[str, list[_Claim]]:
    """The group's entry points by name, in name order, each distribution once per name."""
    claims: dict[str, list[_Claim]] = {}
    entry_points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        claim = _Claim(ep, dist.name if dist is not None else "?", dist.version if dist is not None else "?")
        same_name = claims.setdefault(ep.name, [])
        # The same distribution visible twice on sys.path (an editable install beside a regular
        # one) would otherwise register everything twice, or collide with itself.
        if all(_normalized(c.distribution) != _normalized(claim.distribution) for c in same_name):
            same_name.append(claim)
    return claims


def _normalized(distribution: str) -> str:
    # PEP 503: "Kernelmux_Example.Plugin" and "kernelmux-example-plugin" are one distribution.
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _reserved_entry_point(claim: _Claim) -> str:
    name = claim.entry_point.name
    return (
        f"the entry-point name {name!r} is reserved for kernelmux's built-in {name} backend, whose "
        f"entry point is {builtin_module(name)!r}; this one points at {claim.entry_point.value!r}, "
        f"so it was not imported (fix: rename the entry point under "
        f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"] in {claim.distribution}, and give its "
        f"implementations a backend name of their own; reserved: {', '.join(sorted(RESERVED_NAMES))})"
    )


def _failure(stage: str, error: BaseException) -> str:
    reason = f"{stage}: {_summary(error)}"
    if not isinstance(error, Exception):
        # SystemExit and the like would end the host process; say why this one did not.
        reason += (
            " (contained: a plugin must raise an Exception, never exit the process or raise a bare "
            "BaseException)"
        )
    return reason


def _summary(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    try:
        text = str(error)
    except Exception:  # the plugin's exception class may not print
        text = "(unprintable)"
    return f"{type(error).__name__}: {text}{where}" if text else f"{type(error).__name__}{where}"
