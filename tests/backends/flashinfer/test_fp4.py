"""The flashinfer backend's FP4 entries (fp4_mm on mm_fp4, quantize_mxfp4 and quantize_nvfp4 on
fp4_quantize), dry-run on the CPU against fakes that hold the shipped signatures, checks, layouts and
arithmetic (tests/vendors/flashinfer/gemm/fp4.py, fp4_quantization.py), on a simulated sm_100: results
against the spec's references (scales linear and swizzled), declines
(sm_90 has no FP4 MMA or e2m1 conversion), keyword calls, quarantine, first-call log, registration."""

from __future__ import annotations

import logging

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER
from kernelmux.backends.flashinfer import fp4_mm as mm_adapter
from kernelmux.backends.flashinfer import quantize_mxfp4 as mx_adapter
from kernelmux.backends.flashinfer import quantize_nvfp4 as nv_adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import fp4_mm as mm_spec
from kernelmux.specs import quantize_mxfp4 as mx_spec
from kernelmux.specs import quantize_nvfp4 as nv_spec
from vendors import install_fake, sources

SM100 = simulate("sm_100")
CPU = torch.device("cpu")


def _install(monkeypatch, tmp_path, files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", "0.6.14", files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    import flashinfer.fp4_quantization
    import flashinfer.gemm.fp4

    return flashinfer.gemm.fp4, flashinfer.fp4_quantization


def _case(spec, name, seed=0):
    [case] = [c for c in spec.SPEC.cases if c.name == name]
    return case.make(CPU, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# fp4_mm


def _w4a4(rows, channels, cols, fmt, out_dtype="bfloat16", seed=0):
    return mm_spec._maker(rows, channels, cols, fmt, "w4a4", out_dtype=out_dtype)(
        CPU, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [
    lambda: _case(mm_spec, "small_nvfp4_w4a4"),
    lambda: _case(mm_spec, "deepseek_v3_nvfp4_w4a4_m16_n512_k7168"),
    lambda: _w4a4(7, 32, 32, "nvfp4", "float16"),  # K = 32: two scale columns padded to four
    lambda: _w4a4(130, 64, 256, "nvfp4"),  # M > 128: two row tiles of scales
    lambda: _w4a4(5, 64, 128, "mxfp4"),
    lambda: _w4a4(1, 96, 64, "mxfp4", "float16"),
])
def test_fp4_mm_matches_the_reference(vendor, make):
    kwargs = make()
    assert ask(mm_adapter.supports, mm_spec.SPEC, kwargs, SM100) in (None, mm_adapter.supports(
        mm_spec.SPEC.validate(**kwargs), SM100))  # MXFP4 may be declined here for want of cuDNN
    mm_spec.SPEC.check_close(mm_adapter.fp4_mm(**kwargs), mm_spec.SPEC.reference(**kwargs), kwargs)
    gemm, _ = vendor
    call = gemm.CALLS[-1]
    assert call["backend"] == "auto" and call["use_nvfp4"] == (kwargs["fmt"] == "nvfp4")


def test_fp4_mm_empty_batch_never_reaches_the_vendor(vendor):
    kwargs = _case(mm_spec, "empty_nvfp4_w4a4")
    assert mm_adapter.fp4_mm(**kwargs).shape == (0, 64)
    assert not vendor[0].CALLS


def test_prepare_is_the_metadata_conversion(vendor):
    kwargs = _w4a4(3, 32, 64, "nvfp4")
    prepared = mm_adapter.prepare(kwargs["a"], kwargs["b"], kwargs["b_scale"], "nvfp4", kwargs["a_scale"],
                                  kwargs["b_global_scale"], kwargs["a_global_scale"])
    assert prepared.a_descale.shape == (128, 4) and prepared.b_descale.shape == (128, 4)
    assert torch.equal(prepared.alpha, 1.0 / (kwargs["a_global_scale"].reshape(1)
                                              * kwargs["b_global_scale"].reshape(1)))
    # metadata(kwargs), which the bench times apart, is this conversion.
    timed = mm_adapter.metadata(kwargs)
    assert all(torch.equal(x, y) for x, y in zip(timed, prepared))


@pytest.mark.parametrize("changes, platform, reason", [
    ({}, "sm_90", "mm_fp4 runs on sm_100, sm_103, sm_120, sm_121 only"),
    (dict(mode="w4a16"), "sm_100", "W4A16"),
    (dict(out_dtype="float32"), "sm_100", "bfloat16 or float16 output only"),
    (dict(channels=48), "sm_100", "N and K multiples of 32"),
    (dict(cols=48), "sm_100", "N and K multiples of 32"),
    (dict(fmt="mxfp4"), "sm_120", "needs cuDNN >= 9.14 on sm_120"),
])
def test_fp4_mm_declines_by_name(changes, platform, reason):
    shape = {**dict(rows=4, channels=64, cols=128, fmt="nvfp4", mode="w4a4", out_dtype="bfloat16"), **changes}
    kwargs = mm_spec._maker(shape["rows"], shape["channels"], shape["cols"], shape["fmt"], shape["mode"],
                            out_dtype=shape["out_dtype"])(CPU, torch.Generator().manual_seed(0))
    assert reason in ask(mm_adapter.supports, mm_spec.SPEC, kwargs, simulate(platform))


def test_fp4_mm_mxfp4_needs_cudnn(monkeypatch):
    kwargs = _w4a4(4, 64, 128, "mxfp4")
    monkeypatch.setattr(mm_adapter, "_cudnn_installed", lambda: False)
    assert "nvidia-cudnn-frontend (import cudnn) is not installed" in ask(mm_adapter.supports, mm_spec.SPEC,
                                                                          kwargs, SM100)
    monkeypatch.setattr(mm_adapter, "_cudnn_installed", lambda: True)
    assert ask(mm_adapter.supports, mm_spec.SPEC, kwargs, SM100) is None


# ---------------------------------------------------------------------------------------------
# quantize_mxfp4


MX_SERVED = ["gpt_oss_120b_expert_w_rows64_ceil", "deepseek_v3_m128_ceil", "small_fp16_ceil", "one_block",
             "nonfinite_blocks_ceil", "extremes_bf16_ceil"]


@pytest.mark.parametrize("name", MX_SERVED)
def test_quantize_mxfp4_matches_the_reference(vendor, name):
    kwargs = _case(mx_spec, name)
    assert ask(mx_adapter.supports, mx_spec.SPEC, kwargs, SM100) is None
    mx_spec.SPEC.check_close(mx_adapter.quantize_mxfp4(**kwargs), mx_spec.SPEC.reference(**kwargs), kwargs)
    assert vendor[1].CALLS[-1]["swizzled"] is False  # the spec's linear scales, no conversion back


def test_quantize_mxfp4_zero_blocks_and_strided_rows(vendor):
    # Blocks of -0.0 (the kernel writes code 0x8 there), a one-row view and a column-strided view.
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[1, :32] = -0.0
    x[2] = 0.0
    raw_q, _ = vendor[1].fp4_quantize(x, None, 32, True, False)
    assert int(raw_q[1, 0]) == 0x88  # the kernel's -0.0 codes, which the adapter restores to 0
    for view in (x, x[1:2], torch.cat([x, x], dim=1)[:, ::2]):
        kwargs = dict(x=view, rounding="ceil")
        mx_spec.SPEC.check_close(mx_adapter.quantize_mxfp4(**kwargs), mx_spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("kwargs, platform, reason", [
    (dict(x=torch.randn(2, 64).bfloat16(), rounding="floor"), "sm_100", "OCP's 'floor' it does not do"),
    (dict(x=torch.randn(2, 64), rounding="ceil"), "sm_100", "bf16 or fp16 input only"),
    (dict(x=torch.randn(2, 64).bfloat16(), rounding="ceil"), "sm_90", "not sm_90"),
])
def test_quantize_mxfp4_declines_by_name(kwargs, platform, reason):
    assert reason in ask(mx_adapter.supports, mx_spec.SPEC, kwargs, simulate(platform))


# ---------------------------------------------------------------------------------------------
# quantize_nvfp4: wired, declined


def _exact_nvfp4_input():
    """Values on which FlashInfer's recipe and the spec's agree bit for bit: every block an e2m1 value
    times a power of two with amax 6 * 2^j, so gs, sf and gs / sf are exact either way."""
    generator = torch.Generator().manual_seed(4)
    values = torch.tensor(nv_spec.E2M1_VALUES)[torch.randint(0, 8, (6, 8, 16), generator=generator)]
    values *= torch.where(torch.rand(6, 8, 16, generator=generator) < 0.5, -1.0, 1.0)
    values[..., 0] = 6.0
    values *= 2.0 ** torch.randint(-6, 4, (6, 8, 1), generator=generator).float()
    x = values.view(6, 128)
    x[1, :16] = -0.0  # a zero block: sf 0, and the spec's codes 0 (the kernel writes 0x8 for -0.0)
    return x.bfloat16()


@pytest.mark.parametrize("global_scale", [None, torch.tensor(448.0 / 8.0)])
def test_quantize_nvfp4_wiring_matches_the_reference_where_the_recipes_agree(vendor, global_scale):
    kwargs = dict(x=_exact_nvfp4_input(), global_scale=global_scale)
    nv_spec.SPEC.check_close(nv_adapter.quantize_nvfp4(**kwargs), nv_spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("kwargs, platform, reason", [
    (dict(x=torch.randn(2, 64).bfloat16()), "sm_100", "approximate reciprocals"),
    (dict(x=torch.randn(2, 64).half()), "sm_120", "approximate reciprocals"),
    (dict(x=torch.randn(2, 64)), "sm_100", "bf16 or fp16 input only"),
    (dict(x=torch.randn(2, 64).bfloat16()), "sm_90", "fp4_quantize runs on sm_100, sm_103, sm_120, sm_121 only"),
])
def test_quantize_nvfp4_declines_by_name(kwargs, platform, reason):
    assert reason in ask(nv_adapter.supports, nv_spec.SPEC, kwargs, simulate(platform))


# ---------------------------------------------------------------------------------------------
# The vendor mechanism


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    gemm, quant = fake["flashinfer/gemm/fp4.py"], fake["flashinfer/fp4_quantization.py"]
    gemm_reordered = gemm.replace("def mm_fp4(a, b, a_descale, b_descale, alpha=None,",
                                  "def mm_fp4(b_descale, a_descale, b, a, alpha=None,")
    quant_reordered = quant.replace("def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False,",
                                    "def fp4_quantize(input, sf_use_ue8m0=False, sf_vec_size=16, global_scale=None,")
    assert gemm_reordered != gemm and quant_reordered != quant
    _install(monkeypatch, tmp_path, {**fake, "flashinfer/gemm/fp4.py": gemm_reordered,
                                     "flashinfer/fp4_quantization.py": quant_reordered})
    kwargs = _w4a4(3, 32, 64, "nvfp4")
    mm_spec.SPEC.check_close(mm_adapter.fp4_mm(**kwargs), mm_spec.SPEC.reference(**kwargs), kwargs)
    kwargs = _case(mx_spec, "small_fp16_ceil")
    mx_spec.SPEC.check_close(mx_adapter.quantize_mxfp4(**kwargs), mx_spec.SPEC.reference(**kwargs), kwargs)


def test_a_vendor_without_the_keywords_is_quarantined(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    _install(monkeypatch, tmp_path, {**fake, "flashinfer/fp4_quantization.py":
                                     "def fp4_quantize(input, global_scale=None, sf_vec_size=16):\n    pass\n"})
    reason = "fp4_quantize takes no keyword sf_use_ue8m0, is_sf_swizzled_layout"
    assert reason in FLASHINFER.problem_for(CALLS["quantize_mxfp4"])
    rejected = {impl.backend: why for impl, why in
                Engine(ALL_SPECS, Settings(platform="sm_100")).tables[mx_spec.NAME].rejected}
    assert reason in rejected["flashinfer"]


@pytest.mark.parametrize("op", [mm_spec.NAME, mx_spec.NAME, nv_spec.NAME])
def test_registered_by_requirement(vendor, op):
    on_sm100 = Engine(ALL_SPECS, Settings(platform="sm_100"))
    [impl] = [c.impl for c in on_sm100.tables[op].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith("flashinfer-python 0.6.14: ")
    on_sm90 = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="sm_90")).tables[op].rejected}
    assert "needs features fp4-mma" in on_sm90["flashinfer"]


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(mm_adapter, "first_calls", _vendor.first_calls)
    kwargs = _w4a4(3, 32, 64, "nvfp4")
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        mm_adapter.fp4_mm(**kwargs)
        mm_adapter.fp4_mm(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "may compile" in messages[0] and "took" in messages[1]
    assert list(_vendor.first_calls.seconds()) == [("flashinfer", mm_spec.NAME, ("nvfp4", torch.bfloat16, CPU))]
