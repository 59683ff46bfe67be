"""The xpu backend's quantize_fp8 and quantize_mxfp4: wired to the vendor's quantizers and declined. Against the
fake vllm-xpu-kernels (which models their arithmetic) the adapters run, and inputs on which the vendor's
bits differ from the spec's show that the declines are needed."""

from __future__ import annotations

import pytest
import torch

from kernelmux.backends.xpu import quantize_fp8 as fp8_adapter
from kernelmux.backends.xpu import quantize_mxfp4 as mxfp4_adapter
from kernelmux.platforms import simulate
from kernelmux.specs import quantize_fp8 as fp8_spec
from kernelmux.specs import quantize_mxfp4 as mxfp4_spec


@pytest.mark.parametrize("granularity, fill", [
    ("per_token", 1e-3),    # a row with amax < 1/512: the vendor's scale floor 1/(448*512)
    ("per_group", 1e-3),    # the same floor per 1x128 group (its eps, the spec's 1e-4, is below it)
    ("per_tensor", 0.0),    # no floor per tensor: an all-zero input gets scale 0 and NaN codes
])
def test_quantize_fp8_differs_from_the_spec(vendor, granularity, fill):
    x = torch.full((3, 256), fill, dtype=torch.float32)
    x[:, 1] = -fill / 3
    kwargs = dict(x=x, granularity=granularity, group_size=128, ue8m0=False, fp8_dtype="e4m3fn")
    got = fp8_adapter.quantize_fp8(**kwargs)
    assert tuple(t.shape for t in got) == tuple(t.shape for t in fp8_spec.SPEC.fake(**kwargs))
    expected = fp8_spec.SPEC.reference(**kwargs)
    assert not torch.equal(got[1], expected[1])  # the scales themselves
    with pytest.raises(AssertionError, match="quantize_fp8 q"):
        fp8_spec.SPEC.check_close(got, expected, kwargs)


def test_quantize_fp8_agrees_on_ordinary_rows_apart_from_the_reciprocal(vendor):
    # Away from the floors the scales agree bit for bit; the codes differ only where x * (1/s) and x / s
    # round apart, which random rows rarely hit (the spec requires none).
    x = torch.randn(8, 256) * 3
    kwargs = dict(x=x, granularity="per_token", group_size=128, ue8m0=False, fp8_dtype="e4m3fn")
    q, scale = fp8_adapter.quantize_fp8(**kwargs)
    ref_q, ref_scale = fp8_spec.SPEC.reference(**kwargs)
    assert torch.equal(scale, ref_scale)
    assert (q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean() < 1e-2


def test_quantize_mxfp4_rounds_ties_toward_zero(vendor):
    # A block of amax 6 (scale 1 either way) holding midpoints 0.75, 1.75 and 3.5: the spec rounds them
    # half to even (1, 2, 4), the vendor down (0.5, 1.5, 3).
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, 0.75, 1.75, 3.5])
    q, codes = mxfp4_adapter.quantize_mxfp4(x, "ceil")
    ref_q, ref_codes = mxfp4_spec.SPEC.reference(x=x, rounding="ceil")
    assert torch.equal(codes, ref_codes)  # the block scale agrees here
    assert q[0, :2].tolist() == [0x1 << 4 | 0x7, 0x5 << 4 | 0x3] != ref_q[0, :2].tolist()


def test_quantize_mxfp4_zero_block_gets_another_scale(vendor):
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64)
    _, codes = mxfp4_adapter.quantize_mxfp4(x, "ceil")
    _, ref_codes = mxfp4_spec.SPEC.reference(x=x, rounding="ceil")
    assert ref_codes[0].tolist() == [0, 0] and codes[0].tolist() != [0, 0]


def test_both_decline_every_call_with_the_reason():
    xpu = simulate("xpu")
    assert fp8_adapter.supports(None, xpu) == fp8_adapter.DECLINED and "1 / scale" in fp8_adapter.DECLINED
    assert mxfp4_adapter.supports(None, xpu) == mxfp4_adapter.DECLINED and "ties toward zero" in mxfp4_adapter.DECLINED
