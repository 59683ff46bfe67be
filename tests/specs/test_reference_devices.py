"""The quantizing references round the same on every device: ieee_div against an fp64 oracle on the test
device, and on a GPU every quantize_fp8 / quantize_mxfp4 / quantize_nvfp4 case's reference run there
against the same inputs' reference on the CPU, bit for bit (torch's CUDA division by a Python number is
reciprocal-then-multiply, which moved 1 in ~1000 fp8 codes before the references divided by tensors)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from kernelmux.specs._arith import ieee_div
from kernelmux.specs.quantize_fp8 import SPEC as QUANTIZE_FP8
from kernelmux.specs.quantize_mxfp4 import SPEC as QUANTIZE_MXFP4
from kernelmux.specs.quantize_nvfp4 import SPEC as QUANTIZE_NVFP4

SPECS = {spec.name: spec for spec in (QUANTIZE_FP8, QUANTIZE_MXFP4, QUANTIZE_NVFP4)}
ON_GPU = DEVICE == "cuda"


@pytest.mark.parametrize("denominator", [448.0, 240.0, 6.0, 3.0, 0.1])
def test_ieee_div_rounds_once(denominator: float) -> None:
    gen = torch.Generator().manual_seed(0)
    numerator = torch.cat([torch.rand(200_000, generator=gen) * 500, torch.randn(200_000, generator=gen) * 1e-3])
    got = ieee_div(numerator.to(DEVICE), denominator).cpu()
    # fp64 quotient of the fp32 operands, then fp32: exact enough (53 >= 2 x 24 + 2 bits) to round once.
    want = (numerator.double() / torch.tensor(denominator).float().double()).float()
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"{(got != want).sum().item()} quotients by {denominator} not correctly rounded"


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: compares the references' rounding on the GPU with the "
                                       "CPU's")
@pytest.mark.parametrize("case", [(spec.name, case.name) for spec in SPECS.values() for case in spec.cases
                                  if "quick" in case.tags], ids=lambda c: f"{c[0]}-{c[1]}")
def test_reference_on_the_gpu_equals_the_cpu_bit_for_bit(case: tuple[str, str]) -> None:
    spec = SPECS[case[0]]
    kwargs = spec.case(case[1]).build("cpu", 3)
    on_cpu = _as_tuple(spec.reference(**kwargs))
    on_gpu = _as_tuple(spec.reference(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}))
    for i, (a, b) in enumerate(zip(on_cpu, on_gpu)):
        a, b = a.view(torch.uint8) if a.element_size() == 1 else a, b.cpu()
        b = b.view(torch.uint8) if b.element_size() == 1 else b
        assert torch.equal(a, b), f"{case}: output {i} differs in {(a != b).sum().item()} of {a.numel()} elements"
