"""The xpu backend's scaled_mm and fp4_mm against the fake vllm-xpu-kernels (_xpu_C.fp8_gemm and fp4_gemm with the
shipped schemas, onednn_matmul.cpp's checks and oneDNN's scale-branch logic, so a scale handed over in
another layout is applied as the real library would apply it): results against the spec's references,
the scale conversions and declines (keyword calls: test_backend.py)."""

from __future__ import annotations

import pytest
import torch

from fakes import ask
from kernelmux.backends.xpu import fp4_mm as fp4_adapter
from kernelmux.backends.xpu import scaled_mm as fp8_adapter
from kernelmux.platforms import simulate
from kernelmux.specs import fp4_mm as fp4_spec
from kernelmux.specs import scaled_mm as fp8_spec
from kernelmux.specs.quantize_mxfp4 import quantize_mxfp4

XPU = simulate("xpu")
# scaled_mm's quick cases, and the reason of each the adapter declines.
FP8_DECLINED = {
    "small_tensor_scalar_fp32_bias": "bfloat16 or float16 output only",
    "small_block_bias_fp32": "bfloat16 or float16 output only",
    "n_not_multiple_of_128_channel": "bfloat16 or float16 output only",
    "small_block_fnuz": "float8_e4m3fn operands only",
    "small_channel_fnuz_ue8m0": "float8_e4m3fn operands only",
    "k_not_multiple_of_128_block": "K and N multiples of 128 only",
    "n_not_multiple_of_128_block": "K and N multiples of 128 only",
    "both_not_multiple_of_128_block": "K and N multiples of 128 only",
}


@pytest.mark.parametrize("case", [c.name for c in fp8_spec.SPEC.cases_tagged("quick")])
def test_scaled_mm_spec_cases_match_the_reference_or_are_declined(vendor, case):
    kwargs = fp8_spec.SPEC.case(case).build(seed=2)
    reason = ask(fp8_adapter.supports, fp8_spec.SPEC, kwargs, XPU)
    if case in FP8_DECLINED:
        assert FP8_DECLINED[case] in reason
        return
    assert reason is None
    fp8_spec.SPEC.check_close(fp8_adapter.scaled_mm(**kwargs), fp8_spec.SPEC.reference(**kwargs), kwargs)


def _fp8(m, n, k, layout, seed, out_dtype="bfloat16", bias=False, strided=False):
    return fp8_spec._maker(m, n, k, layout, out_dtype=out_dtype, with_bias=bias)(
        torch.device("cpu"), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m, n, k, layout, out_dtype, bias, branch", [
    (7, 256, 384, "block", "float16", True, "block"),
    (3, 200, 100, "block", "bfloat16", False, "tokenxchannel"),   # one K block: per-token x per-channel
    (1, 1, 64, "block", "bfloat16", False, "tensorxtensor"),      # one row and one channel: per-tensor reads
    (6, 40, 96, "channel", "bfloat16", True, "tokenxchannel"),
    (5, 24, 40, "tensor", "float16", False, "tensorxtensor"),
])
def test_scaled_mm_scale_branches(vendor, m, n, k, layout, out_dtype, bias, branch):
    kwargs = _fp8(m, n, k, layout, seed=m, out_dtype=out_dtype, bias=bias)
    assert ask(fp8_adapter.supports, fp8_spec.SPEC, kwargs, XPU) is None
    fp8_spec.SPEC.check_close(fp8_adapter.scaled_mm(**kwargs), fp8_spec.SPEC.reference(**kwargs), kwargs)
    [(_, call)] = vendor["_xpu_C"].CALLS
    assert (call["branch"], call["nt"]) == (branch, True)  # b.t() is the NT weight, read in place


def test_scaled_mm_reads_strided_activations_and_weights(vendor):
    kwargs = _fp8(9, 256, 256, "block", seed=1)
    for name in ("a", "b"):  # every other row of a twice-as-tall buffer
        tall = torch.empty(2 * kwargs[name].shape[0], kwargs[name].shape[1], dtype=kwargs[name].dtype)
        tall[::2] = kwargs[name]
        kwargs[name] = tall[::2]
    assert ask(fp8_adapter.supports, fp8_spec.SPEC, kwargs, XPU) is None
    fp8_spec.SPEC.check_close(fp8_adapter.scaled_mm(**kwargs), fp8_spec.SPEC.reference(**kwargs), kwargs)


def test_block_scales_untransposed_would_be_misapplied(vendor):
    # Why scale_b is transposed: oneDNN groups the [K, N] weight, so [N/128, K/128] reads as other blocks
    # (with N != K it is refused outright: "Mismatch group size in input and weight").
    kwargs = _fp8(4, 256, 256, "block", seed=3)
    got = torch.ops._xpu_C.fp8_gemm(A=kwargs["a"], B=kwargs["b"].t(), out_dtype=torch.bfloat16,
                                    A_scale_=kwargs["scale_a"], B_scale_=kwargs["scale_b"].contiguous(), bias_=None)
    with pytest.raises(AssertionError, match="scaled_mm"):
        fp8_spec.SPEC.check_close(got, fp8_spec.SPEC.reference(**kwargs), kwargs)


def test_scaled_mm_declines_a_weight_without_a_unit_k_stride():
    kwargs = _fp8(2, 128, 128, "tensor", seed=4)
    kwargs["b"] = kwargs["b"].t().contiguous().t()
    assert "b needs a unit stride along K" in ask(fp8_adapter.supports, fp8_spec.SPEC, kwargs, XPU)


def _fp4(m, n, k, seed, out_dtype="bfloat16", fmt="mxfp4", w4a16=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) / k**0.5
    b, b_scale = quantize_mxfp4(w)
    kwargs = dict(a=x.to(torch.bfloat16), b=b, b_scale=b_scale, fmt=fmt, a_scale=None, b_global_scale=None,
                  a_global_scale=None, out_dtype=out_dtype)
    if not w4a16:
        kwargs["a"], kwargs["a_scale"] = quantize_mxfp4(x)
    return kwargs


@pytest.mark.parametrize("m, n, k, out_dtype", [(5, 48, 64, "bfloat16"), (1, 8, 32, "float16"), (0, 16, 96, "bfloat16"),
                                                (17, 40, 256, "bfloat16")])
def test_fp4_mm_matches_the_reference(vendor, m, n, k, out_dtype):
    kwargs = _fp4(m, n, k, seed=m, out_dtype=out_dtype)
    assert ask(fp4_adapter.supports, fp4_spec.SPEC, kwargs, XPU) is None
    fp4_spec.SPEC.check_close(fp4_adapter.fp4_mm(**kwargs), fp4_spec.SPEC.reference(**kwargs), kwargs)
    assert len(vendor["_xpu_C"].CALLS) == (1 if m else 0)


def test_fp4_mm_spec_cases(vendor):
    accepted = 0
    for case in fp4_spec.SPEC.cases_tagged("quick"):
        kwargs = case.build(seed=6)
        if ask(fp4_adapter.supports, fp4_spec.SPEC, kwargs, XPU) is None:
            fp4_spec.SPEC.check_close(fp4_adapter.fp4_mm(**kwargs), fp4_spec.SPEC.reference(**kwargs), kwargs)
            accepted += 1
    assert accepted >= 1


@pytest.mark.parametrize("changes, reason", [
    (dict(fmt="nvfp4"), "MXFP4 only"),
    (dict(w4a16=True), "W4A4 only"),
    (dict(out_dtype="float32"), "bfloat16 or float16 output only"),
])
def test_fp4_mm_declines_by_name(changes, reason):
    kwargs = _fp4(3, 16, 64, seed=1, **{k: v for k, v in changes.items() if k != "fmt"})
    if changes.get("fmt") == "nvfp4":
        from kernelmux.specs.quantize_nvfp4 import quantize_nvfp4

        w = torch.randn(16, 64)
        kwargs.update(fmt="nvfp4", a=torch.randn(3, 64).to(torch.bfloat16), a_scale=None)
        kwargs["b"], kwargs["b_scale"], kwargs["b_global_scale"] = quantize_nvfp4(w)
    assert reason in ask(fp4_adapter.supports, fp4_spec.SPEC, kwargs, XPU)
