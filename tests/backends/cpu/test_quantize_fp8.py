"""The cpu backend's quantize_fp8 against the spec's reference, bit for bit: every named case on seeds of its
own, with blocks of one row and of several; inputs of any strides, fp32 input left untouched, ragged groups
and an empty batch. The named cases also run in tests/backends/test_conformance.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kernelmux.backends.cpu import quantize_fp8 as impl
from kernelmux.specs import quantize_fp8 as spec


def _check(kwargs: dict, what: str) -> None:
    expected = spec.SPEC.reference(**kwargs)
    actual = impl.quantize_fp8(**kwargs)
    try:
        spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("block_elements", [impl.BLOCK_ELEMENTS, 1, 1000], ids=["default", "row-blocks", "few-rows"])
@pytest.mark.parametrize("name", [case.name for case in spec.SPEC.cases])
def test_named_cases(name: str, block_elements: int) -> None:
    with mock.patch.object(impl, "BLOCK_ELEMENTS", block_elements):
        for seed in (11, 12):
            _check(spec.SPEC.case(name).build(torch.device("cpu"), seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("granularity", spec.GRANULARITIES)
def test_strided_inputs_and_fp32_input_untouched(granularity: str) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 2 * 320, generator=gen)
    for x in (wide[:, ::2], wide[:, :320].t().contiguous().t(), wide[2:7, 40:360]):
        before = x.clone()
        _check(dict(x=x, granularity=granularity, group_size=64), f"{granularity}, strides {x.stride()}")
        assert torch.equal(x, before)
        _check(dict(x=x.to(torch.bfloat16), granularity=granularity, group_size=64, ue8m0=True,
                    fp8_dtype="e4m3fnuz"), f"{granularity}, bf16 e4m3fnuz ue8m0, strides {x.stride()}")


def test_ragged_groups_and_an_empty_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=gen).to(torch.float16)
    _check(dict(x=x, granularity="per_group", group_size=128), "groups of 128, 128, 44")
    _check(dict(x=x, granularity="per_group", group_size=7), "groups of 7")
    for granularity in spec.GRANULARITIES:
        _check(dict(x=torch.empty(0, 64, dtype=torch.bfloat16), granularity=granularity), f"empty, {granularity}")


@pytest.mark.parametrize("fp8_dtype", list(spec.FP8_DTYPES))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_host_scale_is_the_specs(fp8_dtype: str, ue8m0: bool) -> None:
    # One scale (per_tensor, a per_token row) is computed in numpy's fp32 scalars: the spec's bits for maxima
    # of every magnitude, fp32 subnormals and 0 (the 2^-126 floor) to the largest finite values.
    gen = torch.Generator().manual_seed(5)
    amax = torch.cat([torch.exp2(torch.empty(2000).uniform_(-149, 128, generator=gen)),
                      torch.tensor([0.0, 2.0**-149, 448.0 * 2.0**-126, 448.0, 240.0, torch.finfo(torch.float32).max])])
    amax = amax[amax.isfinite()].float()
    expected = spec.scale_from_amax(amax, "per_token", ue8m0, fp8_dtype)
    actual = torch.stack([impl._one_scale(float(a), ue8m0, fp8_dtype, shape=()) for a in amax])
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_row_with_its_scale_on_the_host(dtype: torch.dtype) -> None:
    # per_token over one row and per_tensor take their scale from the host: strided rows, a zero row and a row
    # of tiny values (both at the 2^-126 floor), each dtype, both formats, ue8m0.
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(3, 2 * 256, generator=gen)
    rows = [wide[1:2, ::2], wide[:1, :256].t().contiguous().t(), torch.zeros(1, 256), wide[:1, :256] * 2.0**-120]
    for x in rows:
        for granularity in ("per_token", "per_tensor"):
            for ue8m0 in (False, True):
                for fp8_dtype in spec.FP8_DTYPES:
                    kwargs = dict(x=x.to(dtype), granularity=granularity, ue8m0=ue8m0, fp8_dtype=fp8_dtype)
                    _check(kwargs, f"{granularity} {dtype} {fp8_dtype} ue8m0 {ue8m0}, strides {x.stride()}")
                    assert impl.quantize_fp8(**kwargs)[0].is_contiguous()
