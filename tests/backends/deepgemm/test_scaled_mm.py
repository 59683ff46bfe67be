"""The deepgemm backend's scaled_mm against a fake deep_gemm that holds the shipped signatures, host
checks and scale layouts (tests/vendors/deep_gemm): the adapter's results against the spec's reference,
its declines, its scale-layout conversion, keyword calls, and the vendor mechanism's quarantine and
first-call log. On an H100 with sgl-deep-gemm installed, tests/backends/test_conformance.py runs the
real one against the reference, and the test at the end here the adapter on it directly."""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.deepgemm import CALLS, DEEPGEMM, transform_scales
from kernelmux.backends.deepgemm import scaled_mm as adapter
from kernelmux.conformance import _strided
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import scaled_mm as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8
from vendors import install_fake, sources


def _install(monkeypatch, tmp_path, version="0.1.4.post1", files=None):
    return install_fake(monkeypatch, tmp_path, "deep_gemm", "sgl-deep-gemm", version, files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert DEEPGEMM.problem() is None
    return sys.modules["deep_gemm"]


def _block_call(m, n, k, seed, *, a_view="contiguous", out_dtype="bfloat16", bias=False, device="cpu"):
    """A block-scaled call: a quantized per 1 x 128 group, b per 128 x 128 block (as a served
    DeepSeek-V3 layer is), ``a`` laid out as ``a_view`` says."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator) / k**0.5
    a, scale_a = quantize_fp8(x, "per_group", spec.BLOCK)
    b, scale_b = spec.quantize_weight_blocks(w)
    if a_view == "row_strided":  # rows of a wider buffer: 16-byte aligned, read in place
        wide = torch.zeros(m, k + 128, dtype=a.dtype)
        wide[:, :k] = a
        a = wide[:, :k]
    elif a_view == "misaligned":  # a view starting one byte in: TMA cannot read it in place
        wide = torch.zeros(m, k + 16, dtype=a.dtype)
        wide[:, 1:k + 1] = a
        a = wide[:, 1:k + 1]
    elif a_view == "column_strided":  # every other column: not K-major
        wide = torch.zeros(m, 2 * k, dtype=a.dtype)
        wide[:, ::2] = a
        a = wide[:, ::2]
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                  bias=(torch.randn(n, generator=generator) * 0.1).to(spec.OUT_DTYPES[out_dtype]) if bias else None)
    return {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}


@pytest.mark.parametrize("m, n, k, a_view", [
    (64, 256, 512, "contiguous"),
    (1, 256, 256, "contiguous"),       # one decode token
    (133, 384, 384, "contiguous"),     # M not a multiple of 128 (nor of 4: the scales' TMA padding)
    (7, 200, 256, "contiguous"),       # N = 200: the last weight block holds 72 channels
    (5, 2112, 256, "contiguous"),      # N = 2112, DeepSeek-V3's fused q_a/kv_a projection (16.5 blocks)
    (9, 256, 384, "row_strided"),      # rows of a wider buffer, read in place
    (9, 256, 384, "misaligned"),       # copied by the adapter before TMA reads it
    (9, 256, 384, "column_strided"),   # not K-major: copied
])
def test_adapter_matches_the_reference(vendor, m, n, k, a_view):
    kwargs = _block_call(m, n, k, seed=m + n, a_view=a_view)
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90")) is None
    expected = spec.SPEC.reference(**kwargs)
    actual = adapter.scaled_mm(**kwargs)
    spec.SPEC.check_close(actual, expected, kwargs)
    [call] = vendor.CALLS
    # The prepared activation scales reach the GEMM in its layout: it does not convert them again.
    assert call == dict(m=m, n=n, k=k, compiled_dims="nk", sfa_was_ready=True)


@pytest.mark.parametrize("m", [1, 9, 64])
def test_every_operand_strided_matches_the_reference(vendor, m):
    # The conformance kit's strided check: every tensor a view of stride 2 with garbage between. On an
    # H200 it came out wrong while scale_b's contiguous copy was a temporary (transform_scales).
    kwargs = _block_call(m, 256, 384, seed=m)
    expected = spec.SPEC.reference(**kwargs)
    strided = {k: _strided(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    spec.SPEC.check_close(adapter.scaled_mm(**strided), expected, kwargs)


def test_scale_a_already_in_deepgemms_layout_is_not_copied(vendor):
    kwargs = _block_call(6, 256, 384, seed=3)
    ready = torch.empty_strided((6, 3), (1, 8)).copy_(kwargs["scale_a"])  # MN-major, M padded to 8
    sfa, _ = adapter.prepare_scales(ready, kwargs["scale_b"], 6, 256, 384)
    assert sfa.data_ptr() == ready.data_ptr()
    spec.SPEC.check_close(adapter.scaled_mm(**{**kwargs, "scale_a": ready}), spec.SPEC.reference(**kwargs), kwargs)


def test_transform_scales_holds_an_untransformed_input_and_keeps_a_transformed_one(vendor):
    # The shipped transform returns an input it leaves as is without holding its memory (the fake's
    # _borrowed): a temporary's result must still be readable after the temporary is gone.
    kwargs = _block_call(6, 256, 384, seed=5)
    sfb = transform_scales(kwargs["scale_b"].clone(), mn=256, k=384, recipe=adapter.RECIPE, is_sfa=False)
    gc.collect()
    assert torch.equal(sfb, kwargs["scale_b"])
    sfa = transform_scales(kwargs["scale_a"].clone(), mn=6, k=384, recipe=adapter.RECIPE, is_sfa=True)
    assert sfa.stride() == (1, 8) and torch.equal(sfa, kwargs["scale_a"])  # the vendor's MN-major copy
    out = torch.empty(6, 256, dtype=torch.bfloat16)
    sys.modules["deep_gemm"].fp8_gemm_nt(a=(kwargs["a"], sfa), b=(kwargs["b"], sfb), d=out, recipe=adapter.RECIPE)
    spec.SPEC.check_close(out, spec.SPEC.reference(**kwargs), kwargs)


def test_an_empty_batch_never_reaches_the_vendor(vendor):
    kwargs = _block_call(0, 256, 512, seed=0)
    out = adapter.scaled_mm(**kwargs)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16
    assert vendor.CALLS == []


@pytest.mark.parametrize("m", [1, 3, 4, 130])
def test_prepare_scales_gives_deepgemms_layouts(vendor, m):
    # sfa: MN-major, each K group's column padded to M rounded up to 4 (16 bytes of fp32, TMA's unit).
    kwargs = _block_call(m, 384, 640, seed=m)
    sfa, sfb = adapter.prepare_scales(kwargs["scale_a"], kwargs["scale_b"], m, 384, 640)
    assert torch.equal(sfa, kwargs["scale_a"]) and torch.equal(sfb, kwargs["scale_b"])
    assert sfa.stride() == (1, -(-m // 4) * 4)
    assert sfb.is_contiguous()


@pytest.mark.parametrize("changes, platform, reason", [
    ({}, "sm_100", "on sm_100 DeepGEMM takes UE8M0 scales only"),
    ({}, "sm_120", "run on sm_90 only, not sm_120"),
    ({}, "sm_89", "run on sm_90 only, not sm_89"),
    (dict(scale_a=torch.ones(4, 1), scale_b=torch.ones(256, 1)), "sm_90", "got channel scales"),
    (dict(scale_a=torch.ones(()), scale_b=torch.ones(())), "sm_90", "got tensor scales"),
    (dict(out_dtype="float16"), "sm_90", "bfloat16 output only"),
    (dict(out_dtype="float32"), "sm_90", "bfloat16 output only"),
    (dict(bias=torch.zeros(256, dtype=torch.bfloat16)), "sm_90", "no bias"),
])
def test_supports_declines_by_name(changes, platform, reason):
    kwargs = {**_block_call(4, 256, 512, seed=1), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(platform))


@pytest.mark.parametrize("m, n, k, fp8_dtype, reason", [
    (4, 256, 200, "e4m3fn", "K % 128 == 0 only"),
    (4, 256, 640 + 16, "e4m3fn", "got K = 656"),
    (4, 260, 256, "e4m3fn", "N % 8 == 0 only"),
    (4, 256, 256, "e4m3fnuz", "float8_e4m3fn operands only"),
])
def test_supports_declines_shapes_and_dtypes_by_name(m, n, k, fp8_dtype, reason):
    generator = torch.Generator().manual_seed(2)
    a, scale_a = quantize_fp8(torch.randn(m, k, generator=generator), "per_group", 128, fp8_dtype=fp8_dtype)
    b, scale_b = spec.quantize_weight_blocks(torch.randn(n, k, generator=generator), fp8_dtype=fp8_dtype)
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype="bfloat16", bias=None)
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90"))


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    # A release that reorders the parameters changes nothing: every argument is passed by name.
    fake = sources("deep_gemm")
    shipped = fake["deep_gemm/__init__.py"]
    reordered = shipped.replace(
        "def fp8_fp4_gemm_nt(a, b, d, c=None, recipe=None,",
        "def fp8_fp4_gemm_nt(d, b, a, c=None, recipe=None,").replace(
        "def transform_sf_into_required_layout(sf, mn, k, recipe,",
        "def transform_sf_into_required_layout(k, recipe, mn, sf,")
    assert reordered.count("def fp8_fp4_gemm_nt(d, b, a,") == 1
    assert reordered.count("def transform_sf_into_required_layout(k, recipe, mn, sf,") == 1
    _install(monkeypatch, tmp_path, files={**fake, "deep_gemm/__init__.py": reordered})
    assert DEEPGEMM.problem() is None
    kwargs = _block_call(12, 256, 384, seed=3)
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("version, files, reason", [
    ("0.2.5", None, "sgl-deep-gemm 0.2.5 is outside the tested range >=0.1.4,<0.2"),
    ("0.1.4.post1", {"deep_gemm/__init__.py": "raise OSError('libcudart.so.13: cannot open shared object file')\n"},
     "sgl-deep-gemm 0.1.4.post1: import deep_gemm failed: OSError: libcudart.so.13"),
    ("0.1.4.post1", {"deep_gemm/__init__.py":
                     "def fp8_gemm_nt(a, b, d, c=None, recipe=None):\n    pass\n"
                     "def transform_sf_into_required_layout(sf, mn, k, recipe, is_sfa=None):\n    pass\n"},
     "deep_gemm.fp8_gemm_nt takes no keyword compiled_dims"),
    ("0.1.4.post1", {"deep_gemm/__init__.py":
                     "def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims=''):\n    pass\n"},
     "deep_gemm.transform_sf_into_required_layout: AttributeError"),
])
def test_a_broken_vendor_is_quarantined_with_its_version_and_reason(monkeypatch, tmp_path, version, files, reason):
    _install(monkeypatch, tmp_path, version, files)
    assert reason in DEEPGEMM.problem_for(CALLS["scaled_mm"])
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    rejected = {impl.backend: why for impl, why in engine.tables["scaled_mm"].rejected}
    assert reason in rejected["deepgemm"]


def test_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_vendor, "_problems", {})
    monkeypatch.setattr(type(DEEPGEMM), "version", lambda self: None)
    # The hint names the extra after Vendor.name ("deep_gemm"); pyproject's extra is "deepgemm".
    assert DEEPGEMM.problem().startswith("sgl-deep-gemm is not installed (pip install 'kernelmux[")


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["scaled_mm"].candidates if c.impl.backend == "deepgemm"]
    assert impl.description.startswith("sgl-deep-gemm 0.1.4.post1: fp8_gemm_nt")
    assert impl.supports is adapter.supports and impl.fn is adapter.scaled_mm
    assert engine.distribution("deepgemm").startswith("kernelmux ")
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["scaled_mm"].rejected}
    assert "needs a cuda platform" in on_cpu["deepgemm"]


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/tmp/dg-cache")
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        adapter.scaled_mm(**_block_call(3, 256, 384, seed=5))
        adapter.scaled_mm(**_block_call(9, 256, 384, seed=6))  # same weight shape: no new log
        adapter.scaled_mm(**_block_call(3, 512, 384, seed=7))  # another N: a new kernel
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6, messages
    assert "first call for ('scale layout', 3) on " in messages[0]
    assert "first call for (256, 384) on " in messages[2] and "/tmp/dg-cache" in messages[2]
    assert "first call for (512, 384) on " in messages[4]
    assert all("took" in m for m in messages[1::2])
    assert list(_vendor.first_calls.seconds()) == [
        ("deep_gemm", "scaled_mm", ("scale layout", 3)), ("deep_gemm", "scaled_mm", (256, 384)),
        ("deep_gemm", "scaled_mm", (512, 384))]


_REAL = importlib.util.find_spec("deep_gemm") is not None
_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
@pytest.mark.parametrize("m, n, k", [(1, 7168, 2048), (133, 2112, 7168), (4096, 576, 7168)])
def test_real_deepgemm_matches_the_reference_on_sm90(m, n, k):
    # DeepSeek-V3 shapes, M from decode to prefill; N 2112 and 576 end in half a weight block.
    assert DEEPGEMM.problem() is None, DEEPGEMM.problem()
    kwargs = _block_call(m, n, k, seed=11, device="cuda")
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
@pytest.mark.parametrize("m, n, k", [(1, 256, 256), (1, 7168, 2048), (64, 7168, 2048)])
@pytest.mark.parametrize("strided", [("a",), ("b",), ("scale_a",), ("scale_b",), ("a", "b", "scale_a", "scale_b")])
def test_real_deepgemm_reads_strided_inputs(m, n, k, strided):
    # The kit's strided check gave outputs near 1e38 on an H200 (M = 1, every tensor strided): scale_b's
    # temporary contiguous copy was freed under DeepGEMM's untransformed result, and a's copy reused it.
    kwargs = _block_call(m, n, k, seed=12, device="cuda")
    views = {k: _strided(v) if k in strided else v for k, v in kwargs.items()}
    spec.SPEC.check_close(adapter.scaled_mm(**views), spec.SPEC.reference(**kwargs), kwargs)


def test_metadata_is_the_scale_conversion_the_call_makes(vendor):
    # The bench times metadata(kwargs) apart: it must be exactly the call's own conversion.
    kwargs = _block_call(33, 256, 384, seed=4)
    sfa, sfb = adapter.metadata(kwargs)
    expected_a, expected_b = adapter.prepare_scales(kwargs["scale_a"], kwargs["scale_b"], 33, 256, 384)
    assert torch.equal(sfa, expected_a) and sfa.stride() == expected_a.stride() and torch.equal(sfb, expected_b)
    assert adapter.metadata(_block_call(0, 256, 384, seed=4)) is None
