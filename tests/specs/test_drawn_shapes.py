"""Every spec's ``shapes`` strategy (the conformance kit's drawn shapes) draws cases the spec
accepts: validation passes, the reference runs, and the fake agrees with its outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kernelmux.engine._engine import output_problem
from kernelmux.specs import ALL_SPECS

DRAWING = [spec for spec in ALL_SPECS if spec.shapes is not None]


def test_every_spec_draws_shapes():
    assert {spec.name for spec in DRAWING} == {spec.name for spec in ALL_SPECS}


@pytest.mark.parametrize("spec", DRAWING, ids=lambda spec: spec.name)
def test_drawn_cases_are_valid_calls(spec):
    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(spec.shapes())
    def drawn(case):
        assert case.name.startswith("drawn: ") and case.tags == {"drawn"}
        kwargs = case.build("cpu", 3)
        spec.validate(**kwargs)
        result = spec.reference(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        problem = output_problem(result, spec.fake(**kwargs))
        assert problem is None, problem

    drawn()
