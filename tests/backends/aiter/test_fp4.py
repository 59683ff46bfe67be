"""The aiter backend's FP4 entries against the fake aiter: fp4_mm on gemm_a4w4 (gfx950; B and both
e8m0 scales shuffled by aiter's own functions per call, undone in the fake from the layouts' index
formulas), and quantize_mxfp4 wired to dynamic_mxfp4_quant but declined for its 'even' scale rounding."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS, QUANTIZE_MXFP4_REASON
from kernelmux.backends.aiter import fp4_mm as adapter
from kernelmux.backends.aiter import quantize_mxfp4 as quantizer
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import fp4_mm as spec
from kernelmux.specs import quantize_mxfp4 as quantize_spec
from vendors import reversed_signature, sources

GFX950 = simulate("gfx950")


def _w4a4(m, n, k, seed=0, **options):
    make = spec._maker(m, n, k, "mxfp4", "w4a4", **options)
    return make(torch.device("cpu"), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m, n, k, options", [
    (8, 32, 128, {}),
    (1, 48, 256, {}),                       # one decode token
    (5, 16, 192, {"zero_blocks": True}),    # all-zero blocks: scale code 0, 2^-127
    (300, 32, 64, {}),                      # M past 256: the shuffled scale's second row tile
    (33, 64, 512, {}),                      # 16 K blocks: two 8-column scale tiles
])
def test_fp4_mm_matches_the_reference(gfx950, m, n, k, options):
    kwargs = _w4a4(m, n, k, seed=m, **options)
    assert ask(adapter.supports, spec.SPEC, kwargs, GFX950) is None
    spec.SPEC.check_close(adapter.fp4_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    [call] = sys.modules["aiter.ops.gemm_op_a4w4"].CALLS
    assert call == dict(m=m, n=n, bpreshuffle=True)


def test_an_empty_batch_never_reaches_the_vendor(gfx950):
    out = adapter.fp4_mm(**_w4a4(0, 32, 128))
    assert out.shape == (0, 32) and sys.modules["aiter.ops.gemm_op_a4w4"].CALLS == []


def test_prepare_pads_the_scales_to_aiters_tiles(gfx950):
    prepared = adapter.metadata(_w4a4(5, 48, 256))
    assert prepared.a_scale.shape == (256, 8) and prepared.b_scale.shape == (256, 8)
    assert prepared.b.is_shuffled and prepared.a.dtype == prepared.b.dtype == adapter.FP4X2


@pytest.mark.parametrize("kwargs, reason", [
    (spec.SPEC.case("small_nvfp4_w4a4").build(seed=1), "MXFP4 only"),
    (spec.SPEC.case("small_mxfp4_w4a16").build(seed=1), "W4A4 only"),
    (spec.SPEC.case("small_mxfp4_w4a4").build(seed=1), "bfloat16 output only"),
    (_w4a4(4, 20, 128), "N % 16 and K % 64 only"),
    (_w4a4(4, 32, 96), "got N = 32, K = 96"),
])
def test_fp4_mm_declines_by_name(kwargs, reason):
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, GFX950)


def test_fp4_mm_is_gfx950_only(gfx942):
    engine = Engine(ALL_SPECS, Settings(platform="gfx942"))
    rejected = {impl.backend: why for impl, why in engine.tables["fp4_mm"].rejected}
    assert rejected["aiter"] == "needs arch in {gfx950}, this is gfx942"
    with pytest.raises(RuntimeError, match="not supported on gfx942"):  # what the real one raises there
        adapter.fp4_mm(**_w4a4(4, 32, 128))


def test_fp4_mm_calls_the_vendor_by_keyword(install_aiter):
    fake = sources("aiter")
    path = "aiter/ops/gemm_op_a4w4.py"
    install_aiter("gfx950", files={**fake, path: reversed_signature(fake[path], "gemm_a4w4")})
    assert AITER.problem_for(CALLS["fp4_mm"]) is None
    kwargs = _w4a4(6, 32, 128, seed=4)
    spec.SPEC.check_close(adapter.fp4_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


def test_quantize_mxfp4_is_rejected_at_startup_with_the_rounding(gfx950):
    engine = Engine(ALL_SPECS, Settings(platform="gfx950"))
    rejected = {impl.backend: why for impl, why in engine.tables["quantize_mxfp4"].rejected}
    assert rejected["aiter"] == QUANTIZE_MXFP4_REASON


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_the_even_rounding_differs_from_each_of_the_specs(gfx950, rounding):
    # A block amax of 7 (mantissa 1.75) is scaled 2^1 by 'even' and 'ceil' but 2^0 by 'floor'; one of
    # 6.5 (mantissa 1.625) 2^0 by 'even' and 'floor' but 2^1 by 'ceil': the reason is not hypothetical.
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 7.0, 6.5
    kwargs = dict(x=x, rounding=rounding)
    assert ask(quantizer.supports, quantize_spec.SPEC, kwargs, GFX950) == QUANTIZE_MXFP4_REASON
    _, got = quantizer.quantize_mxfp4(**kwargs)
    _, want = quantize_spec.SPEC.reference(**kwargs)
    assert got.tolist() != want.tolist()
    assert got[:, 0].tolist() == [128, 127]  # 'even': 2^1 for 7, 2^0 for 6.5
