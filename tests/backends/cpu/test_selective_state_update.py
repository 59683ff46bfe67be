"""The cpu backend's selective_state_update against the spec's reference: every named case on seeds of its
own (padding requests, untouched NaN slots, bf16 and fp32 states, every optional input), and strided
inputs, a strided state cache included. The named cases also run in tests/backends/test_conformance.py."""

from __future__ import annotations

import pytest
import torch

from kernelmux.backends.cpu import selective_state_update as impl
from kernelmux.specs import selective_state_update as spec


def _check(kwargs: dict, what: str) -> None:
    reference_kwargs = dict(kwargs, state=kwargs["state"].clone())
    expected_y = spec.SPEC.reference(**reference_kwargs)
    actual_y = impl.selective_state_update(**kwargs)
    try:
        spec.SPEC.check_close((actual_y, kwargs["state"]), (expected_y, reference_kwargs["state"]), kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("name", [case.name for case in spec.SPEC.cases])
def test_named_cases(name: str) -> None:
    # The 180 MB model caches take seconds to build and compare: one seed (conformance runs them on another).
    tags = spec.SPEC.case(name).tags
    for seed in (21,) if "model" in tags and "quick" not in tags else (21, 22):
        _check(spec.SPEC.case(name).build(torch.device("cpu"), seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs_and_state(state_dtype: torch.dtype) -> None:
    kwargs = spec.SPEC.case("small_permuted").build(torch.device("cpu"), 5)
    # The cache a slice of a wider one (every other head), x / z / B / C transposed copies viewed back.
    wide = torch.full((kwargs["state"].shape[0], 2 * kwargs["state"].shape[1], *kwargs["state"].shape[2:]),
                      float("nan"), dtype=state_dtype)
    wide[:, ::2] = kwargs["state"].to(state_dtype)
    strided = dict(kwargs, state=wide[:, ::2])
    for name in ("x", "z", "B", "C"):
        strided[name] = kwargs[name].transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided[name].is_contiguous()
    _check(strided, f"strided inputs, {state_dtype} state")
    assert wide[:, 1::2].isnan().all(), "the heads between the slice's were written"
