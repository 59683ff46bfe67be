"""The flashinfer backend's scaled_mm against a fake flashinfer.gemm that holds the shipped signatures and
checks and reads operands and scales from raw memory as the kernels do (tests/vendors/flashinfer/gemm):
the adapter's results against the spec's reference on sm_90 (fp8_blockscale_gemm_sm90) and, dry-run,
on sm_100/sm_120 (gemm_fp8_nt_groupwise); its declines, scale layouts, keyword calls, and the vendor
mechanism's quarantine and first-call log. On an H100 with flashinfer installed,
tests/backends/test_conformance.py runs the real one against the reference, and so does the test at the end."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER
from kernelmux.backends.flashinfer import scaled_mm as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import scaled_mm as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8
from vendors import install_fake, sources


def _install(monkeypatch, tmp_path, version="0.6.14", files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", version, files)


def _simulate(monkeypatch, capability):
    """The device as ``capability`` to both sides: the adapter's probe and the fake's own check."""
    monkeypatch.setattr(adapter, "_capability", lambda device: capability)
    monkeypatch.setattr(sys.modules["flashinfer.gemm.fp8"], "SIMULATED_CAPABILITY", capability)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    fake = __import__("flashinfer.gemm.fp8").gemm.fp8
    _simulate(monkeypatch, (9, 0))
    return fake


def _block_call(m, n, k, seed, *, a_view="contiguous", out_dtype="bfloat16", device="cpu"):
    """A block-scaled call as a served DeepSeek-V3 layer makes it, ``a`` laid out as ``a_view`` says."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    a, scale_a = quantize_fp8(x, "per_group", spec.BLOCK)
    b, scale_b = spec.quantize_weight_blocks(torch.randn(n, k, generator=generator) / k**0.5)
    if a_view == "row_strided":  # rows of a wider buffer: the kernels take no strides, so copied
        wide = torch.zeros(m, k + 128, dtype=a.dtype)
        wide[:, :k] = a
        a = wide[:, :k]
    elif a_view == "misaligned":  # contiguous but one byte off a 16-byte boundary: copied for TMA
        flat = torch.zeros(m * k + 16, dtype=a.dtype)
        a = flat[1:m * k + 1].view(m, k).copy_(a)
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=None)
    return {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}


@pytest.mark.parametrize("m, n, k, a_view", [
    (64, 256, 512, "contiguous"),
    (1, 256, 256, "contiguous"),      # one decode token (the kernel's swapAB path on a GPU)
    (133, 384, 384, "contiguous"),    # M not a multiple of 128, nor of 4 (the scales' TMA padding)
    (7, 192, 256, "contiguous"),      # N = 192: the last weight block holds 64 channels
    (9, 256, 384, "row_strided"),
    (9, 256, 384, "misaligned"),
])
def test_sm90_adapter_matches_the_reference(vendor, m, n, k, a_view):
    kwargs = _block_call(m, n, k, seed=m + n, a_view=a_view)
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90")) is None
    expected = spec.SPEC.reference(**kwargs)
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), expected, kwargs)
    assert vendor.CALLS == [("fp8_blockscale_gemm_sm90", m, n, k, None)]


@pytest.mark.parametrize("capability, m, n, k, out_dtype", [
    ((10, 0), 64, 256, 512, "bfloat16"),
    ((10, 0), 1, 256, 256, "float16"),     # M = 1: padded to 4 rows for the kernel, cut back after
    ((10, 3), 258, 384, 384, "bfloat16"),  # M >= 256: the two-SM MMA; M % 4 = 2
    ((12, 0), 7, 128, 256, "bfloat16"),
])
def test_groupwise_adapter_matches_the_reference_dry_run(vendor, monkeypatch, capability, m, n, k, out_dtype):
    # No sm_100 or sm_120 here: the path that runs there, against the fake, on a simulated device.
    _simulate(monkeypatch, capability)
    kwargs = _block_call(m, n, k, seed=m, out_dtype=out_dtype)
    arch = f"sm_{capability[0]}{capability[1]}"
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate(arch)) is None
    actual = adapter.scaled_mm(**kwargs)
    assert actual.shape == (m, n)
    spec.SPEC.check_close(actual, spec.SPEC.reference(**kwargs), kwargs)
    [(name, rows, *_, extra)] = vendor.CALLS
    assert (name, rows) == ("gemm_fp8_nt_groupwise", -(-m // 4) * 4)
    assert extra == dict(scale_major_mode="K", mma_sm=2 if m >= 256 else 1)


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_an_empty_batch_never_reaches_the_vendor(vendor, monkeypatch, capability):
    _simulate(monkeypatch, capability)
    out = adapter.scaled_mm(**_block_call(0, 256, 512, seed=0))
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16
    assert vendor.CALLS == []


@pytest.mark.parametrize("m", [1, 3, 4, 130])
def test_prepare_scales_gives_each_kernels_layout(m):
    kwargs = _block_call(m, 384, 640, seed=m)
    scale_a, scale_b = kwargs["scale_a"], kwargs["scale_b"]
    rows = -(-m // 4) * 4
    # sm_90: MN-major, each K group's column padded to M rounded up to 4, as its quantizer writes them.
    sfa, sfb = adapter.prepare_scales(scale_a, scale_b, m, (9, 0))
    assert torch.equal(sfa, scale_a) and sfa.stride() == (1, rows)
    raw = sfa.as_strided((5, rows), (rows, 1), sfa.storage_offset())
    assert torch.equal(raw[:, :m], scale_a.T)
    assert torch.equal(sfb, scale_b) and sfb.is_contiguous()
    # sm_100/sm_120, K-major: the canonical layout, rows padded with the operand.
    sfa, sfb = adapter.prepare_scales(scale_a, scale_b, m, (10, 0))
    assert sfa.shape == (rows, 5) and sfa.is_contiguous() and torch.equal(sfa[:m], scale_a)
    assert torch.equal(sfb, scale_b) and sfb.is_contiguous()


def test_the_fake_reads_scales_as_the_kernel_does(vendor):
    # Guard for the fake itself: row-major activation scales, as FlashInfer's docstring might suggest,
    # are read column-major by the kernel, giving a wrong product (or reading past them).
    kwargs = _block_call(8, 256, 512, seed=9)
    out = torch.empty(8, 256, dtype=torch.bfloat16)
    vendor.fp8_blockscale_gemm_sm90(input=kwargs["a"], weight=kwargs["b"], input_scale=kwargs["scale_a"],
                                    weight_scale=kwargs["scale_b"], out=out)
    with pytest.raises(AssertionError):
        spec.SPEC.check_close(out, spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("changes, platform, reason", [
    ({}, "sm_89", "not sm_89"),
    ({}, "sm_80", "not sm_80"),
    (dict(scale_a=torch.ones(4, 1), scale_b=torch.ones(256, 1)), "sm_90", "got channel scales"),
    (dict(scale_a=torch.ones(()), scale_b=torch.ones(())), "sm_100", "got tensor scales"),
    (dict(out_dtype="float16"), "sm_90", "bfloat16 output only on sm_90"),
    (dict(out_dtype="float32"), "sm_90", "bfloat16 output only on sm_90"),
    (dict(out_dtype="float32"), "sm_100", "bfloat16 or float16 output only"),
    (dict(bias=torch.zeros(256, dtype=torch.bfloat16)), "sm_90", "no bias"),
    (dict(bias=torch.zeros(256, dtype=torch.bfloat16)), "sm_120", "no bias"),
])
def test_supports_declines_by_name(changes, platform, reason):
    kwargs = {**_block_call(4, 256, 512, seed=1), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(platform))


@pytest.mark.parametrize("m, n, k, fp8_dtype, platform, reason", [
    (4, 256, 200, "e4m3fn", "sm_90", "K % 128 == 0 and N % 64 == 0 only"),
    (4, 200, 256, "e4m3fn", "sm_90", "got N = 200, K = 256"),
    (4, 192, 256, "e4m3fn", "sm_100", "N and K multiples of 128 only on sm_100"),
    (4, 256, 200, "e4m3fn", "sm_121", "got N = 256, K = 200"),
    (4, 256, 256, "e4m3fnuz", "sm_90", "float8_e4m3fn operands only"),
])
def test_supports_declines_shapes_and_dtypes_by_name(m, n, k, fp8_dtype, platform, reason):
    generator = torch.Generator().manual_seed(2)
    a, scale_a = quantize_fp8(torch.randn(m, k, generator=generator), "per_group", 128, fp8_dtype=fp8_dtype)
    b, scale_b = spec.quantize_weight_blocks(torch.randn(n, k, generator=generator), fp8_dtype=fp8_dtype)
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype="bfloat16", bias=None)
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(platform))


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path, capability):
    # A release that reorders the parameters changes nothing: every argument is passed by name.
    fake = sources("flashinfer")
    shipped = fake["flashinfer/gemm/fp8.py"]
    reordered = shipped.replace(
        "def fp8_blockscale_gemm_sm90(input, weight, input_scale=None, weight_scale=None, out=None, out_dtype=None):",
        "def fp8_blockscale_gemm_sm90(weight_scale, input_scale, weight, input, out_dtype=None, out=None):").replace(
        "def gemm_fp8_nt_groupwise(a, b, a_scale, b_scale, scale_major_mode=None, mma_sm=1,",
        "def gemm_fp8_nt_groupwise(b_scale, a_scale, b, a, mma_sm=1, scale_major_mode=None,")
    assert reordered.count("(weight_scale, input_scale, weight, input,") == 1
    assert reordered.count("(b_scale, a_scale, b, a, mma_sm=1,") == 1
    _install(monkeypatch, tmp_path, files={**fake, "flashinfer/gemm/fp8.py": reordered})
    assert FLASHINFER.problem() is None
    __import__("flashinfer.gemm.fp8")
    _simulate(monkeypatch, capability)
    kwargs = _block_call(12, 256, 384, seed=3)
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


_GEMM = "flashinfer/gemm/__init__.py"
_SM90_IMPORT = "from .fp8 import fp8_blockscale_gemm_sm90 as fp8_blockscale_gemm_sm90\n"
_GROUPWISE_IMPORT = "from .fp8 import gemm_fp8_nt_groupwise as gemm_fp8_nt_groupwise\n"


@pytest.mark.parametrize("replaced, replacement, reason", [
    (_SM90_IMPORT, "", "flashinfer.gemm.fp8_blockscale_gemm_sm90: AttributeError"),
    (_SM90_IMPORT, "def fp8_blockscale_gemm_sm90(input, weight, input_scale=None, weight_scale=None):\n    pass\n",
     "fp8_blockscale_gemm_sm90 takes no keyword out, out_dtype"),
    (_GROUPWISE_IMPORT,
     "def gemm_fp8_nt_groupwise(a, b, a_scale, b_scale, scale_major_mode=None, out=None, backend='cutlass'):\n"
     "    pass\n",
     "gemm_fp8_nt_groupwise takes no keyword mma_sm, scale_granularity_mnk"),
])
def test_a_broken_vendor_is_quarantined_with_its_reason(monkeypatch, tmp_path, replaced, replacement, reason):
    # The fake flashinfer.gemm with one of this op's functions missing or taking fewer keywords.
    fake = sources("flashinfer")
    assert replaced in fake[_GEMM]
    _install(monkeypatch, tmp_path, files={**fake, _GEMM: fake[_GEMM].replace(replaced, replacement)})
    assert reason in FLASHINFER.problem_for(CALLS["scaled_mm"])
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    rejected = {impl.backend: why for impl, why in engine.tables["scaled_mm"].rejected}
    assert reason in rejected["flashinfer"]


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["scaled_mm"].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith("flashinfer-python 0.6.14: block scales")
    assert impl.supports is adapter.supports and impl.fn is adapter.scaled_mm
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["scaled_mm"].rejected}
    assert "needs a cuda platform" in on_cpu["flashinfer"]


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        adapter.scaled_mm(**_block_call(3, 256, 384, seed=5))
        adapter.scaled_mm(**_block_call(9, 256, 384, seed=6))  # same weight shape: no new log
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "first call for ('fp8_blockscale_gemm_sm90', 256, 384) on " in messages[0]
    assert "took" in messages[1]
    assert list(_vendor.first_calls.seconds()) == [
        ("flashinfer", "scaled_mm", ("fp8_blockscale_gemm_sm90", 256, 384))]


_REAL = importlib.util.find_spec("flashinfer") is not None
_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with flashinfer-python installed")
@pytest.mark.parametrize("m, n, k", [(1, 7168, 2048), (31, 2048, 7168), (133, 2112, 7168), (4096, 576, 7168)])
def test_real_fp8_blockscale_gemm_sm90_matches_the_reference(m, n, k):
    # DeepSeek-V3 shapes; M 1 and 31 take its swapAB kernel (M < 32), 133 and 4096 the normal one.
    assert FLASHINFER.problem() is None, FLASHINFER.problem()
    kwargs = _block_call(m, n, k, seed=11, device="cuda")
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_metadata_is_the_scale_conversion_the_call_makes(vendor, monkeypatch, capability):
    # The bench times metadata(kwargs) apart: it must be exactly the call's own conversion.
    _simulate(monkeypatch, capability)
    kwargs = _block_call(33, 256, 384, seed=4)
    sfa, sfb = adapter.metadata(kwargs)
    expected_a, expected_b = adapter.prepare_scales(kwargs["scale_a"], kwargs["scale_b"], 33, capability)
    assert torch.equal(sfa, expected_a) and sfa.stride() == expected_a.stride() and torch.equal(sfb, expected_b)
    assert adapter.metadata(_block_call(0, 256, 384, seed=4)) is None
