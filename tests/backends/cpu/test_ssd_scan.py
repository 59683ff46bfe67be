"""The cpu backend's ssd_scan against the spec's reference: every named case on seeds of its own with chunks
batched by default, one at a time and a few at a time; strided inputs; and its rounding against the
algorithm in fp64 (strong decays included) no worse than the reference's. The named cases also run in
tests/backends/test_conformance.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kernelmux.backends.cpu import ssd_scan as impl
from kernelmux.specs import ssd_scan as spec

ARGUMENTS = ("x", "dt", "A", "B", "C", "cu_seqlens", "D", "z", "dt_bias", "dt_softplus", "dt_min", "dt_max",
             "initial_states", "chunk_size")


def _check(kwargs: dict, what: str) -> None:
    try:
        spec.SPEC.check_close(impl.ssd_scan(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("limit", [impl.MAX_DECAY_ELEMENTS, 1, 300], ids=["default", "one-chunk", "few-chunks"])
@pytest.mark.parametrize("name", [case.name for case in spec.SPEC.cases if "1024" not in case.name])
def test_named_cases(name: str, limit: int) -> None:
    with mock.patch.object(impl, "MAX_DECAY_ELEMENTS", limit):
        for seed in (31, 32):
            _check(spec.SPEC.case(name).build(torch.device("cpu"), seed), f"{name}, seed {seed}")


def test_strided_inputs() -> None:
    kwargs = spec.SPEC.case("small_varlen").build(torch.device("cpu"), 6)
    strided = dict(kwargs)
    for name in ("x", "z", "B", "C", "dt"):
        strided[name] = kwargs[name].transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided[name].is_contiguous()
    wide = torch.full((*kwargs["initial_states"].shape[:-1], 2 * kwargs["initial_states"].shape[-1]), float("nan"))
    wide[..., ::2] = kwargs["initial_states"]
    strided["initial_states"] = wide[..., ::2]
    _check(strided, "strided inputs")
    assert wide[..., 1::2].isnan().all() and torch.equal(wide[..., ::2], kwargs["initial_states"])


@pytest.mark.parametrize("name", ["strong_decay", "small_varlen", "chunk_size_1", "small_bf16_limits"])
def test_rounding_against_fp64(name: str) -> None:
    # The fp64 run of the spec's algorithm is exact to far below fp32; each implementation's largest error
    # relative to the largest output.
    kwargs = spec.SPEC.case(name).build(torch.device("cpu"), 7)
    exact = spec._ssd_scan(*(kwargs[k] for k in ARGUMENTS), torch.float64)
    for got_out, ref_out, exact_out in zip(impl.ssd_scan(**kwargs), spec.SPEC.reference(**kwargs), exact):
        scale = exact_out.abs().max()
        ours = ((got_out.double() - exact_out).abs().max() / scale).item()
        theirs = ((ref_out.double() - exact_out).abs().max() / scale).item()
        assert ours <= 2 * theirs + 1e-7, f"{name}: cpu {ours:.2e} against the reference's {theirs:.2e}"
