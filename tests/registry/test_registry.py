"""Registration: signature, duplicate and version checks with errors that name plugin, op and
difference; quarantine of broken plugins; strict mode."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from fakes import Counter, FakePlugin, RaisingPlugin, fake_impl
from kernelmux.errors import PluginLoadError, RegistrationError
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.ops.specs.grouped_topk import SPEC
from kernelmux.registry import Implementation, Registry, signature_difference

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
