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
