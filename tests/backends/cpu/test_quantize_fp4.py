"""The cpu backend's quantize_nvfp4 and quantize_mxfp4 against the specs' references, bit for bit: every case on
seeds of its own through both code routes (the search and the integer passes), several row steps, every e2m1
rounding boundary with both signs, strided inputs, and an fp32 input left untouched (its fp32 copy is the one
widened and scaled in place)."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernelmux.backends.cpu import _fp4
from kernelmux.backends.cpu import quantize_mxfp4 as mx_impl
from kernelmux.backends.cpu import quantize_nvfp4 as nv_impl
from kernelmux.specs import quantize_mxfp4 as mx_spec
from kernelmux.specs import quantize_nvfp4 as nv_spec

OPS = {"quantize_nvfp4": (nv_spec.SPEC, nv_impl.quantize_nvfp4),
       "quantize_mxfp4": (mx_spec.SPEC, mx_impl.quantize_mxfp4)}
ROUTES = {"search": 1 << 40, "integer": 0}  # encode_packed's SEARCH_MAX_VALUES


def _check(op: str, kwargs: dict, what: str) -> None:
    spec, fn = OPS[op]
    expected = spec.reference(**kwargs)
    x_before = kwargs["x"].clone()
    try:
        spec.check_close(fn(**kwargs), expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
    assert torch.equal(kwargs["x"].contiguous().view(torch.uint8), x_before.contiguous().view(torch.uint8)), \
        f"{what}: x was modified"


@pytest.mark.parametrize("op", list(OPS))
def test_signature_matches_the_spec(op: str) -> None:
    spec, fn = OPS[op]
    assert inspect.signature(fn) == spec.signature


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("op, name", [(op, case.name) for op, (spec, _) in OPS.items() for case in spec.cases])
def test_cases_bit_for_bit(op: str, name: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fp4, "SEARCH_MAX_VALUES", ROUTES[route])
    for seed in (51, 52):
        _check(op, OPS[op][0].case(name).build("cpu", seed), f"{name}, seed {seed}, {route} route")


@pytest.mark.parametrize("op", list(OPS))
def test_rows_in_several_steps(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 rows a step over 7 rows (a short last step); NVFP4's dynamic scale then reads x twice.
    monkeypatch.setattr(nv_impl, "STEP_ELEMENTS", 3 * 64)
    monkeypatch.setattr(mx_impl, "STEP_ELEMENTS", 3 * 64)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(53)).to(torch.bfloat16)
    _check(op, dict(x=x), "7 rows, 3 a step")
    if op == "quantize_nvfp4":
        _check(op, dict(x=x, global_scale=torch.tensor([300.0])), "7 rows, 3 a step, passed-in scale")


def _boundaries() -> torch.Tensor:
    """fp32 magnitudes on and one ulp either side of every e2m1 midpoint and code, beyond the saturation at 6, and
    zero, each with both signs, as rows of 31."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    values = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1).abs()])
    values = torch.cat([values, -values])
    return torch.cat([values, values.new_zeros(-values.numel() % 31)]).view(-1, 31)


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_e2m1_boundary(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fp4, "SEARCH_MAX_VALUES", ROUTES[route])
    values = _boundaries()
    # MXFP4, floor: a 4 in each row of 32 makes the scale 1, so each code is the value's own rounding.
    _check("quantize_mxfp4", dict(x=torch.cat([values.new_full((values.shape[0], 1), 4.0), values], 1)),
           f"every e2m1 boundary, {route} route")
    # NVFP4: a global scale of 448 * 6 / 6 and blocks holding 6 give sf 448 and a ratio of exactly 1.
    sixteen = torch.cat([values.flatten(), values.new_zeros(-values.numel() % 15)]).view(-1, 15)
    x = torch.cat([sixteen.new_full((sixteen.shape[0], 1), 6.0), sixteen], 1)
    _check("quantize_nvfp4", dict(x=x, global_scale=torch.tensor(448.0)), f"every e2m1 boundary, {route} route")


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("op", list(OPS))
def test_strided_inputs(op: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fp4, "SEARCH_MAX_VALUES", ROUTES[route])
    base = torch.randn(9, 256, generator=torch.Generator().manual_seed(54)).to(torch.float16)
    _check(op, dict(x=base.t().contiguous().t()), f"a column-major x, {route} route")
    _check(op, dict(x=base[::2, 64:192]), f"every other row, a column slice, {route} route")
