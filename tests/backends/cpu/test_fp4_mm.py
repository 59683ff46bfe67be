"""The cpu backend's fp4_mm against the spec's reference: every named case (both formats, W4A16 and W4A4, NaN
and zero blocks, empty batches) on seeds of its own, with weights decoded whole, one row at a time and in
chunks with a short last one; and strided operands and scales. The decoding itself is checked bit for bit
over every byte and scale code in tests/backends/cpu/test_fused_moe.py (the shared _fp4 module)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kernelmux.backends.cpu import fp4_mm as impl
from kernelmux.specs import fp4_mm as spec


def _check(kwargs: dict, what: str) -> None:
    out = impl.fp4_mm(**kwargs)
    assert out.is_contiguous(), f"{what}: strides {out.stride()}, the spec's fake output is contiguous"
    try:
        spec.SPEC.check_close(out, spec.SPEC.reference(**kwargs), kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("chunk", [impl.CHUNK_ELEMENTS, 1, 1000], ids=["whole", "row", "chunks"])
@pytest.mark.parametrize("name", [case.name for case in spec.SPEC.cases])
def test_named_cases(name: str, chunk: int) -> None:
    with mock.patch.object(impl, "CHUNK_ELEMENTS", chunk):
        for seed in (41, 42):
            _check(spec.SPEC.case(name).build(torch.device("cpu"), seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("name", ["small_nvfp4_w4a4", "small_mxfp4_w4a16", "small_nvfp4_w4a16"])
def test_strided_operands_and_scales(name: str) -> None:
    kwargs = spec.SPEC.case(name).build(torch.device("cpu"), 8)
    strided = dict(kwargs)
    for key in ("a", "b", "b_scale", "a_scale"):
        if kwargs[key] is not None:
            strided[key] = kwargs[key].t().contiguous().t()  # column-major copies of the same values
            assert not strided[key].is_contiguous() or strided[key].shape[1] == 1
    _check(strided, f"{name}, column-major operands")
