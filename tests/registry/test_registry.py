"""Registration: signature, duplicate and version checks with errors that name plugin, op and
difference; names a plugin does not own; quarantine of broken plugins (BaseExceptions included) and
of plugins that register nothing; strict mode."""

from __future__ import annotations

import importlib.metadata
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch

import kernelmux.errors as errors
from fakes import Counter, FakePlugin, RaisingPlugin, fake_impl
from kernelmux.engine import Engine, Settings
from kernelmux.errors import PluginLoadError, RegistrationError
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC
from kernelmux.registry import (
    ENTRY_POINT_GROUP,
    Backend,
    Implementation,
    Registry,
    hookimpl,
    signature_difference,
)

SPECS = {spec.name: spec for spec in ALL_SPECS}


def _impl(fn, backend="bad"):
    return Implementation(op="grouped_topk", backend=backend, fn=fn, spec_version=SPEC.version)


def renamed(logits: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
            scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
            e_score_correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError


def other_default(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int,
                  topk_group: int, scoring_func: str = "sigmoid", routed_scaling_factor: float = 1.0,
                  e_score_correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError


def missing_param(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int,
                  topk_group: int, scoring_func: str = "softmax",
                  routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError


def other_annotation(gating_output: torch.Tensor, topk: float, renormalize: bool, num_expert_group: int,
                     topk_group: int, scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                     e_score_correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError


@pytest.mark.parametrize(
    "fn, fragment",
    [
        (renamed, "parameter 0 is named 'logits', the spec names it 'gating_output'"),
        (other_default, "'scoring_func' defaults to 'sigmoid', the spec's default is 'softmax'"),
        (missing_param, "missing parameters ['e_score_correction_bias']"),
        (other_annotation, "'topk' is annotated"),
    ],
)
def test_signature_difference_is_named(fn, fragment):
    assert fragment in signature_difference(SPEC.signature, fn)
    registry = Registry(SPECS)
    registry.add(_impl(fn), plugin="vendor")
    (rejection,) = registry.rejections
    assert (rejection.plugin, rejection.op, rejection.backend) == ("vendor", "grouped_topk", "bad")
    assert fragment in rejection.reason
    assert ("grouped_topk", "bad") not in registry.implementations


def test_strict_registration_raises_typed_error_naming_plugin_op_and_difference():
    registry = Registry(SPECS, strict=True)
    with pytest.raises(RegistrationError) as info:
        registry.add(_impl(renamed), plugin="vendor")
    assert info.value.plugin == "vendor" and info.value.op == "grouped_topk"
    assert "plugin 'vendor'" in str(info.value) and "grouped_topk:bad" in str(info.value)
    assert "gating_output" in str(info.value)


def test_duplicate_op_backend_is_rejected_not_overwritten():
    registry = Registry(SPECS)
    first, second = Counter(), Counter()
    registry.register_plugin(FakePlugin(fake_impl("fast", first)), "vendor-a")
    registry.register_plugin(FakePlugin(fake_impl("fast", second)), "vendor-b")
    assert registry.implementations[("grouped_topk", "fast")].plugin == "vendor-a"
    (rejection,) = registry.rejections
    assert rejection.plugin == "vendor-b"
    assert "already registered by plugin 'vendor-a'" in rejection.reason


def test_spec_version_mismatch_is_rejected():
    registry = Registry(SPECS)
    registry.add(fake_impl("old", Counter(), spec_version=SPEC.version + 1), plugin="vendor")
    (rejection,) = registry.rejections
    assert f"implements spec version {SPEC.version + 1}" in rejection.reason
    assert f"installed spec is version {SPEC.version}" in rejection.reason


def test_unknown_op_and_non_record_are_rejected():
    registry = Registry(SPECS)
    registry.add(Implementation(op="no_such_op", backend="x", fn=renamed, spec_version=1), plugin="p")
    registry.register_plugin(FakePlugin("not a record"), "q")  # type: ignore[arg-type]
    reasons = [r.reason for r in registry.rejections]
    assert any("no spec named 'no_such_op'" in r for r in reasons)
    assert any("returned str, expected kernelmux Implementation" in r for r in reasons)


def test_plugin_whose_hook_raises_is_quarantined_and_others_still_load():
    registry = Registry(SPECS)
    registry.register_plugin(RaisingPlugin(), "broken")
    registry.register_plugin(FakePlugin(fake_impl("fine", Counter())), "fine")
    (quarantined,) = registry.quarantined
    assert quarantined.name == "broken"
    assert "RuntimeError: backend library failed to initialize" in quarantined.reason
    assert ("grouped_topk", "fine") in registry.implementations
    assert [p.name for p in registry.plugins] == ["fine"]


def test_strict_mode_makes_a_broken_plugin_fatal():
    registry = Registry(SPECS, strict=True)
    with pytest.raises(PluginLoadError) as info:
        registry.register_plugin(RaisingPlugin(), "broken")
    assert info.value.plugin == "broken"


def test_implementation_record_is_validated_on_creation():
    with pytest.raises(TypeError, match="fn must be callable"):
        Implementation(op="grouped_topk", backend="x", fn=None, spec_version=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec_version must be an int"):
        Implementation(op="grouped_topk", backend="x", fn=renamed, spec_version="1")  # type: ignore[arg-type]


def test_builtin_entry_points_register_every_builtin_backend():
    registry = Registry(SPECS)
    registry.load_entry_points(allow={"reference", "cpu", "triton"})
    backends = {backend for (_, backend) in registry.implementations}
    assert {"reference", "cpu"} <= backends
    assert not registry.rejections, registry.rejections
    assert {p.distribution for p in registry.plugins} == {"kernelmux"}


def test_every_builtin_implementation_has_the_spec_signature():
    registry = Registry(SPECS)
    registry.load_entry_points(allow={"reference", "cpu", "triton"})
    for (op, backend), impl in registry.implementations.items():
        assert signature_difference(SPECS[op].signature, impl.fn) is None, f"{op}:{backend}"


# -- installed entry points, faked ---------------------------------------------------------------


@dataclass(frozen=True)
class FakeDist:
    name: str
    version: str = "1.0"


KERNELMUX = FakeDist("kernelmux", "0.1.0")
VENDOR = FakeDist("vendor-turbo", "6.6.6")


@dataclass
class FakeEntryPoint:
    """What the registry reads of an importlib.metadata entry point; counts its imports."""

    name: str
    value: str
    dist: FakeDist
    load_plugin: Callable[[], Any]
    loads: int = 0

    def load(self) -> Any:
        self.loads += 1
        return self.load_plugin()


def entry_point(name: str, value: str, dist: FakeDist, plugin: Any = None) -> FakeEntryPoint:
    return FakeEntryPoint(name, value, dist, lambda: plugin)


def builtin(name: str, *impls: Implementation) -> FakeEntryPoint:
    """The built-in plugin of a reserved name, declared as pyproject.toml declares the real ones."""
    return entry_point(name, f"kernelmux.backends.{name}", KERNELMUX, FakePlugin(*impls))


@pytest.fixture
def installed(monkeypatch):
    """Call with entry points to make them the whole ``kernelmux.backends`` group, in sys.path
    order."""

    def install(*entry_points: FakeEntryPoint) -> None:
        def entry_points_(**selection):
            assert selection == {"group": ENTRY_POINT_GROUP}, selection
            return list(entry_points)

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points_)

    return install


def other_spec_impl(backend: str) -> Implementation:
    """A valid record for an op other than grouped_topk (its spec's reference as fn)."""
    spec = next(s for s in ALL_SPECS if s.name != SPEC.name)
    return Implementation(op=spec.name, backend=backend, fn=spec.reference, spec_version=spec.version)


# -- reserved names ------------------------------------------------------------------------------


@pytest.mark.parametrize("allow", [False, True], ids=["all-plugins", "allow-list-names-it"])
@pytest.mark.parametrize("name", [b.value for b in Backend])
def test_a_reserved_entry_point_name_from_another_distribution_is_quarantined(installed, name, allow):
    """An entry point named like a built-in backend, first on sys.path, is quarantined without
    being imported (also when an allow-list names it); the built-in loads and owns the backend."""
    impostor = entry_point(name, "vendor_turbo", VENDOR,
                           FakePlugin(fake_impl(name, Counter(), priority=1000)))
    real = builtin(name, fake_impl(name, Counter()))
    installed(impostor, real)
    registry = Registry(SPECS)
    registry.load_entry_points({name} if allow else None)

    assert (impostor.loads, real.loads) == (0, 1)
    (quarantined,) = registry.quarantined
    assert (quarantined.name, quarantined.distribution) == (name, "vendor-turbo")
    assert quarantined.version == "6.6.6"
    assert "reserved" in quarantined.reason and "vendor-turbo" in quarantined.reason
    assert f"kernelmux.backends.{name}" in quarantined.reason and "'vendor_turbo'" in quarantined.reason
    assert [(p.name, p.distribution) for p in registry.plugins] == [(name, "kernelmux")]
    kept = registry.implementations[(SPEC.name, name)]
    assert (kept.plugin, kept.priority) == (name, 0)


def test_a_reserved_entry_point_name_is_quarantined_even_without_its_builtin(installed):
    impostor = entry_point("aiter", "vendor_turbo", VENDOR, FakePlugin(fake_impl("aiter", Counter())))
    installed(impostor)
    registry = Registry(SPECS)
    registry.load_entry_points()
    assert impostor.loads == 0
    assert [(q.name, q.distribution) for q in registry.quarantined] == [("aiter", "vendor-turbo")]
    assert not registry.plugins and not registry.implementations


def test_strict_mode_raises_on_a_reserved_entry_point_name(installed):
    installed(builtin("cpu"), entry_point("cpu", "vendor_turbo", VENDOR, FakePlugin()))
    with pytest.raises(errors.PluginConflictError) as info:
        Registry(SPECS, strict=True).load_entry_points()
    assert isinstance(info.value, PluginLoadError)
    assert (info.value.plugin, info.value.distribution) == ("cpu", "vendor-turbo")
    assert "plugin 'cpu' (from vendor-turbo)" in str(info.value) and "reserved" in str(info.value)


@pytest.mark.parametrize("name", [b.value for b in Backend])
def test_registering_a_plugin_object_under_a_reserved_name_is_quarantined(name):
    registry = Registry(SPECS)
    registry.register_plugin(FakePlugin(fake_impl("mine", Counter())), name)
    (quarantined,) = registry.quarantined
    assert quarantined.name == name and "reserved" in quarantined.reason
    assert not registry.plugins and not registry.implementations
    assert not registry.manager.has_plugin(name)


@pytest.mark.parametrize("allow", [{"reference", "cpu"}, {"reference"}], ids=["cpu-loaded", "cpu-not-loaded"])
def test_configure_plugins_cannot_replace_a_builtin(allow):
    """Engine(plugins={"cpu": ...}) (what configure(plugins=...) builds) is quarantined as a
    reserved name, whether or not the built-in cpu plugin was loaded before it."""
    impostor = FakePlugin(fake_impl("cpu", Counter(), priority=1000))
    engine = Engine(ALL_SPECS, Settings(allow_plugins=frozenset(allow)), plugins={"cpu": impostor})
    (quarantined,) = engine.registry.quarantined
    assert (quarantined.name, quarantined.distribution) == ("cpu", "(api)")
    assert "reserved" in quarantined.reason
    cpu = engine.registry.implementations.get((SPEC.name, "cpu"))
    if "cpu" in allow:
        assert (cpu.plugin, cpu.priority) == ("cpu", 10)
    else:
        assert cpu is None


def test_strict_mode_raises_on_a_plugin_object_under_a_reserved_name():
    with pytest.raises(errors.PluginConflictError, match="reserved"):
        Registry(SPECS, strict=True).register_plugin(FakePlugin(), "triton")


def test_a_reserved_backend_registered_by_another_plugin_is_rejected(installed):
    """Plugin ``accel`` loads before ``cpu`` (entry points load in name order) and registers
    backend ``cpu``: that record is rejected naming its distribution, its own one is kept."""
    records = (fake_impl("cpu", Counter(), priority=1000), fake_impl("accel", Counter()))
    accel = entry_point("accel", "accel_kernels", FakeDist("accel-kernels"), FakePlugin(*records))
    installed(accel, builtin("cpu", fake_impl("cpu", Counter())))
    registry = Registry(SPECS)
    registry.load_entry_points()

    (rejection,) = registry.rejections
    assert (rejection.plugin, rejection.op, rejection.backend) == ("accel", SPEC.name, "cpu")
    assert "reserved" in rejection.reason and "accel-kernels" in rejection.reason
    assert registry.implementations[(SPEC.name, "cpu")].plugin == "cpu"
    assert registry.implementations[(SPEC.name, "accel")].plugin == "accel"


def test_a_reserved_backend_is_rejected_from_the_api_and_raised_in_strict_mode():
    registry = Registry(SPECS)
    registry.add(fake_impl("reference", Counter()), plugin="vendor")
    registry.register_plugin(FakePlugin(fake_impl("cuda", Counter())), "vendor-b",
                             distribution="vendor-dist")
    assert [(r.plugin, r.backend) for r in registry.rejections] == [
        ("vendor", "reference"), ("vendor-b", "cuda")
    ]
    assert all("reserved" in r.reason for r in registry.rejections)
    assert "vendor-dist" in registry.rejections[1].reason
    assert not registry.implementations
    with pytest.raises(RegistrationError, match="reserved"):
        Registry(SPECS, strict=True).add(fake_impl("cpu", Counter()), plugin="vendor")


# -- one owner per plugin name and per backend name ------------------------------------------------


def test_two_distributions_declaring_one_entry_point_name_are_both_quarantined(installed):
    first, second = (
        entry_point("fast", module, FakeDist(dist, version), FakePlugin(fake_impl("fast", Counter())))
        for module, dist, version in (("fast_a", "fast-a", "1.0"), ("fast_b", "fast-b", "2.0"))
    )
    installed(first, second)
    registry = Registry(SPECS)
    registry.load_entry_points()

    assert (first.loads, second.loads) == (0, 0)
    reasons = {q.distribution: q.reason for q in registry.quarantined if q.name == "fast"}
    assert set(reasons) == {"fast-a", "fast-b"}
    assert "fast-b 2.0" in reasons["fast-a"] and "fast-a 1.0" in reasons["fast-b"]
    assert not registry.plugins and not registry.implementations
    with pytest.raises(errors.PluginConflictError, match="also declared by"):
        Registry(SPECS, strict=True).load_entry_points()


def test_one_distribution_visible_twice_loads_once(installed):
    """An editable install beside a regular one: one distribution (names equal once normalized),
    loaded once and not reported as a conflict."""
    plugin = FakePlugin(fake_impl("example", Counter()))
    first = entry_point("example", "example_plugin", FakeDist("Example_Plugin"), plugin)
    second = entry_point("example", "example_plugin", FakeDist("example-plugin"), plugin)
    installed(first, second)
    registry = Registry(SPECS)
    registry.load_entry_points()
    assert (first.loads, second.loads) == (1, 0)
    assert not registry.quarantined and not registry.rejections
    assert [p.name for p in registry.plugins] == ["example"]


def test_a_backend_name_used_by_two_plugins_keeps_its_first_owner():
    """Different ops, so no op:backend pair collides; the backend name still has one owner."""
    registry = Registry(SPECS)
    registry.register_plugin(FakePlugin(fake_impl("shared", Counter())), "one", distribution="one-kernels")
    registry.register_plugin(FakePlugin(other_spec_impl("shared")), "two", distribution="two-kernels")
    (rejection,) = registry.rejections
    assert (rejection.plugin, rejection.backend) == ("two", "shared")
    assert "plugin 'one' (from one-kernels)" in rejection.reason and "two-kernels" in rejection.reason
    assert {impl.plugin for impl in registry.implementations.values()} == {"one"}
    assert [p.implementations for p in registry.plugins] == [1, 0]


# -- plugins that raise BaseException ----------------------------------------------------------------


class PluginOutcome(BaseException):
    """Like pytest's outcome exceptions: a BaseException that is neither SystemExit nor
    KeyboardInterrupt."""


BASE_EXCEPTIONS = {
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": lambda: GeneratorExit("closed"),
    "custom": lambda: PluginOutcome("plugin outcome"),
    # pytest.fail's exception, not pytest.skip's: uncontained, it fails this test instead of
    # skipping it, so the test cannot pass by accident.
    "pytest.fail": lambda: pytest.fail.Exception("failed inside the plugin"),
}


class RaisesInHook:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    @hookimpl
    def kernelmux_implementations(self):
        raise self.error


class RaisesOnRegister:
    """pluggy lists a plugin's attributes (dir()) while registering it: this one's listing raises."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __dir__(self):
        raise self.error


def _raising(error: BaseException) -> Callable[[], Any]:
    def load():
        raise error

    return load


def _load_in_stage(registry: Registry, installed, stage: str, error: BaseException) -> None:
    if stage == "import":
        installed(FakeEntryPoint("vendor", "vendor_plugin", VENDOR, _raising(error)))
        registry.load_entry_points()
    elif stage == "register":
        registry.register_plugin(RaisesOnRegister(error), "vendor", distribution="vendor-turbo")
    else:
        registry.register_plugin(RaisesInHook(error), "vendor", distribution="vendor-turbo")


STAGES = {"import": "import failed", "register": "registration failed", "hook": "registration failed"}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("make_error", list(BASE_EXCEPTIONS.values()), ids=list(BASE_EXCEPTIONS))
def test_a_base_exception_from_a_plugin_is_quarantined(installed, stage, make_error):
    error = make_error()
    registry = Registry(SPECS)
    _load_in_stage(registry, installed, stage, error)

    (quarantined,) = registry.quarantined
    assert (quarantined.name, quarantined.distribution) == ("vendor", "vendor-turbo")
    assert quarantined.reason.startswith(f"{STAGES[stage]}: {type(error).__name__}"), quarantined.reason
    assert "contained" in quarantined.reason
    assert not registry.plugins and not registry.manager.has_plugin("vendor")
    # The registry goes on working.
    registry.register_plugin(FakePlugin(fake_impl("fine", Counter())), "fine")
    assert (SPEC.name, "fine") in registry.implementations


@pytest.mark.parametrize("stage", list(STAGES))
def test_keyboard_interrupt_from_a_plugin_still_propagates(installed, stage):
    with pytest.raises(KeyboardInterrupt):
        _load_in_stage(Registry(SPECS), installed, stage, KeyboardInterrupt())


def test_strict_mode_raises_a_typed_error_for_sys_exit_at_import(installed):
    installed(FakeEntryPoint("vendor", "vendor_plugin", VENDOR, _raising(SystemExit(3))))
    with pytest.raises(PluginLoadError, match="import failed: SystemExit: 3") as info:
        Registry(SPECS, strict=True).load_entry_points()
    assert isinstance(info.value.__cause__, SystemExit)


def test_registering_the_same_object_twice_keeps_the_first_registration():
    plugin = FakePlugin(fake_impl("once", Counter()))
    registry = Registry(SPECS)
    registry.register_plugin(plugin, "first")
    registry.register_plugin(plugin, "second")
    assert [q.name for q in registry.quarantined] == ["second"]
    assert registry.manager.get_plugin("first") is plugin


# -- plugins that register nothing -------------------------------------------------------------------


class UndecoratedPlugin:
    def kernelmux_implementations(self):
        return [fake_impl("lost", Counter())]


class MisspeltHookPlugin:
    @hookimpl
    def kernelmux_implementation(self):
        return [fake_impl("lost", Counter())]


def _undecorated_module() -> types.ModuleType:
    module = types.ModuleType("vendor_plugin")
    module.kernelmux_implementations = lambda: [fake_impl("lost", Counter())]
    return module


@pytest.mark.parametrize("make_plugin", [_undecorated_module, UndecoratedPlugin], ids=["module", "object"])
def test_a_hook_without_hookimpl_is_quarantined_saying_so(make_plugin):
    registry = Registry(SPECS)
    registry.register_plugin(make_plugin(), "vendor", distribution="vendor-turbo")
    (quarantined,) = registry.quarantined
    assert quarantined.name == "vendor"
    assert quarantined.reason.startswith(
        "defines kernelmux_implementations without @kernelmux.hookimpl, so nothing was registered"
    )
    assert not registry.plugins and not registry.manager.has_plugin("vendor")


def test_a_decorated_hook_with_a_misspelt_name_is_quarantined():
    registry = Registry(SPECS)
    registry.register_plugin(MisspeltHookPlugin(), "vendor")
    (quarantined,) = registry.quarantined
    assert "unknown hook 'kernelmux_implementation'" in quarantined.reason
    assert not registry.plugins
    registry.register_plugin(FakePlugin(fake_impl("fine", Counter())), "fine")  # pending hook undone
    assert [p.name for p in registry.plugins] == ["fine"]


def test_each_plugin_counts_the_implementations_it_registered():
    registry = Registry(SPECS)
    records = (fake_impl("fast", Counter()), fake_impl("fast", Counter()), other_spec_impl("fast"))
    registry.register_plugin(FakePlugin(*records), "vendor")  # the second is a duplicate
    registry.register_plugin(FakePlugin(), "empty")
    assert [(p.name, p.implementations) for p in registry.plugins] == [("vendor", 2), ("empty", 0)]
