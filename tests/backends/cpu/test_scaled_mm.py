"""The cpu backend's scaled_mm against the spec's reference: every named case on seeds of its own, with b
dequantized in one block, in 128-row blocks and in blocks of several; the dequantized operands bit for bit
(every fp8 code of both formats under scales of every layout); inputs of any strides; NaN codes. The named
cases also run in tests/backends/test_conformance.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kernelmux.backends.cpu import scaled_mm as impl
from kernelmux.specs import scaled_mm as spec

SMALL = [case.name for case in spec.SPEC.cases if "model" not in case.tags]
MODEL_QUICK = [case.name for case in spec.SPEC.cases if "model" in case.tags and "quick" in case.tags]


def _check(kwargs: dict, what: str) -> None:
    expected = spec.SPEC.reference(**kwargs)
    actual = impl.scaled_mm(**kwargs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    try:
        spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("block_elements", [impl.BLOCK_ELEMENTS, 1, 3 * 128 * 384],
                         ids=["default", "128-row-blocks", "several-blocks"])
@pytest.mark.parametrize("name", SMALL + MODEL_QUICK)
def test_named_cases(name: str, block_elements: int) -> None:
    with mock.patch.object(impl, "BLOCK_ELEMENTS", block_elements):
        for seed in (21, 22):
            _check(spec.SPEC.case(name).build(torch.device("cpu"), seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_dequantized_operands_are_the_references_bit_for_bit(dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(5)
    rows, cols = 256, 200  # every code in each row; K not a multiple of 128
    codes = (torch.arange(rows * cols) % 256).to(torch.uint8).view(rows, cols)
    codes = codes[torch.randperm(rows, generator=gen)].view(dtype)
    # a = b = the codes (M = N = 256): each operand's scales in the layout's shapes.
    scale_a, scale_b = {
        "tensor": (torch.tensor(0.37), torch.tensor(1.9)),
        "channel": (torch.rand(rows, 1, generator=gen) * 3 + 1e-3, torch.rand(rows, 1, generator=gen) * 3 + 1e-3),
        "block": (torch.rand(rows, 2, generator=gen) * 3 + 1e-3, torch.rand(2, 2, generator=gen) * 3 + 1e-3),
    }[layout]
    want_a, want_b = spec.dequantize_operands(codes, codes, scale_a, scale_b)
    scratch = torch.empty(codes.numel(), dtype=torch.int16)
    torch.testing.assert_close(impl._dequantized(codes, scale_a, scratch, block_rows=False), want_a, rtol=0, atol=0,
                               equal_nan=True)
    torch.testing.assert_close(impl._dequantized(codes, scale_b, scratch, block_rows=layout == "block"), want_b,
                               rtol=0, atol=0, equal_nan=True)


def test_strided_operands() -> None:
    kwargs = spec.SPEC.case("small_block_bias_fp32").build(torch.device("cpu"), 7)
    wide_a = torch.zeros(kwargs["a"].shape[0], 2 * kwargs["a"].shape[1], dtype=torch.uint8)
    wide_a[:, ::2] = kwargs["a"].view(torch.uint8)
    kwargs["a"] = wide_a.view(kwargs["a"].dtype)[:, ::2]
    kwargs["b"] = kwargs["b"].t().contiguous().t()
    kwargs["scale_a"] = kwargs["scale_a"].t().contiguous().t()
    assert not kwargs["a"].is_contiguous() and not kwargs["b"].is_contiguous()
    _check(kwargs, "strided a, b and scale_a")
