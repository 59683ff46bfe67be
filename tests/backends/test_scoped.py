"""backends/_scoped.py: the one mechanism behind every backend's launch overrides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kernelmux.backends._scoped import PlanSetting, ScopedSetting


def test_override_applies_inside_the_block_and_restores_nested_values():
    setting = ScopedSetting("use_thing", "a")
    with setting.override("b") as value:
        assert value == "b" and setting.current == "b"
        with setting.override("c"):
            assert setting.current == "c"
        assert setting.current == "b"
    assert setting.current == "a" == setting.default


def test_override_restores_after_an_exception():
    setting = ScopedSetting("use_thing", 1)
    with pytest.raises(RuntimeError, match="inside"):
        with setting.override(2):
            raise RuntimeError("inside")
    assert setting.current == 1


def test_a_refused_value_names_the_override_and_never_takes_effect():
    setting = ScopedSetting("use_thing", 1, lambda v: None if v > 0 else f"must be positive, got {v}")
    with pytest.raises(ValueError, match=r"^use_thing: must be positive, got -3$"):
        with setting.override(-3):
            pytest.fail("the block must not run")
    assert setting.current == 1


@dataclass(frozen=True)
class _Plan:
    splits: int = 1
    warps: int = 4


def test_plan_fields_replace_the_default_not_the_value_in_force():
    plans = PlanSetting("override_plan", _Plan())
    with plans.override_fields(splits=8):
        with plans.override_fields(warps=8):
            assert plans.current == _Plan(splits=1, warps=8)
        assert plans.current == _Plan(splits=8)
    assert plans.current == _Plan()
    with pytest.raises(TypeError):
        with plans.override_fields(stages=3):
            pass
