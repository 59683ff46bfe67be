"""The aiter backend's scaled_mm against the fake aiter (tests/vendors/aiter/ops/gemm_op_a8w8.py): block
scales on gemm_a8w8_blockscale, row-wise and per-tensor ones on gemm_a8w8 (one K pass), e4m3fnuz on
gfx942 and e4m3fn on gfx950; declines by name and keyword calls."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS
from kernelmux.backends.aiter import scaled_mm as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import scaled_mm as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8
from vendors import reversed_signature, sources

FLAVOUR = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}


def _call(m, n, k, scaling, arch="gfx942", seed=0, *, out_dtype="bfloat16", a_view="contiguous"):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator) / k**0.5
    flavour = FLAVOUR[arch]
    if scaling == "block":
        a, scale_a = quantize_fp8(x, "per_group", spec.BLOCK, False, flavour)
        b, scale_b = spec.quantize_weight_blocks(w, False, flavour)
    elif scaling == "channel":
        a, scale_a = quantize_fp8(x, "per_token", spec.BLOCK, False, flavour)
        b, scale_b = quantize_fp8(w, "per_token", spec.BLOCK, False, flavour)
    else:
        a, scale_a = quantize_fp8(x, "per_tensor", spec.BLOCK, False, flavour)
        b, scale_b = quantize_fp8(w, "per_tensor", spec.BLOCK, False, flavour)
    if a_view == "row_strided":  # rows of a wider buffer, 16-byte aligned: read in place
        wide = torch.zeros(m, k + 128, dtype=a.dtype)
        wide[:, :k] = a
        a = wide[:, :k]
    elif a_view == "misaligned":  # one byte in: copied first
        wide = torch.zeros(m, k + 16, dtype=a.dtype)
        wide[:, 1:k + 1] = a
        a = wide[:, 1:k + 1]
    return dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=None)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("m, n, k, scaling, a_view, out_dtype", [
    (33, 256, 512, "block", "contiguous", "bfloat16"),
    (1, 2048, 1536, "block", "contiguous", "float16"),   # one decode token, DeepSeek-V3-like N x K
    (9, 256, 384, "block", "row_strided", "bfloat16"),
    (9, 256, 384, "block", "misaligned", "bfloat16"),
    (17, 384, 256, "channel", "contiguous", "bfloat16"),
    (5, 128, 128, "tensor", "contiguous", "float16"),
])
def test_adapter_matches_the_reference(install_aiter, arch, m, n, k, scaling, a_view, out_dtype):
    install_aiter(arch)
    kwargs = _call(m, n, k, scaling, arch, seed=m + n, out_dtype=out_dtype, a_view=a_view)
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate(arch)) is None
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    [call] = sys.modules["aiter.ops.gemm_op_a8w8"].CALLS
    if scaling == "block":
        assert call == dict(op="gemm_a8w8_blockscale", preshuffled=False)
    else:
        assert call == dict(op="gemm_a8w8", splitK=0, bias=False)  # one K pass, the output rounded once


def test_an_empty_batch_never_reaches_the_vendor(gfx942):
    out = adapter.scaled_mm(**_call(0, 256, 256, "block"))
    assert out.shape == (0, 256) and sys.modules["aiter.ops.gemm_op_a8w8"].CALLS == []


def test_per_tensor_scales_are_broadcast_to_rows_and_channels():
    kwargs = _call(6, 128, 128, "tensor")
    x_scale, w_scale = adapter.metadata(kwargs)
    assert x_scale.shape == (6, 1) and w_scale.shape == (128, 1) and x_scale.is_contiguous()
    assert torch.all(x_scale == kwargs["scale_a"]) and torch.all(w_scale == kwargs["scale_b"])


@pytest.mark.parametrize("changes, arch, reason", [
    ({}, "gfx950", "e4m3fn operands only on gfx950"),            # e4m3fnuz operands on an MI355
    (dict(out_dtype="float32"), "gfx942", "bfloat16 or float16 output only"),
    (dict(bias=torch.zeros(256, dtype=torch.bfloat16)), "gfx942", "no bias"),
])
def test_supports_declines_by_name(changes, arch, reason):
    kwargs = {**_call(4, 256, 256, "block"), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(arch))


@pytest.mark.parametrize("n, k", [(200, 256), (256, 200), (256, 1000)])
def test_shapes_outside_aiters_tests_are_declined(n, k):
    assert f"got N = {n}, K = {k}" in ask(adapter.supports, spec.SPEC, _call(4, n, k, "block"), simulate("gfx942"))


def test_e4m3fnuz_operands_are_refused_by_the_gfx950_fake(gfx950):
    # The fake's dtypes.fp8 follows the arch, as aiter's does: what supports declines fails there.
    with pytest.raises(TypeError, match="aiter's fp8 is torch.float8_e4m3fn"):
        adapter.scaled_mm(**_call(4, 256, 256, "block", "gfx942"))


@pytest.mark.parametrize("function", ["gemm_a8w8", "gemm_a8w8_blockscale"])
def test_the_vendor_is_called_by_keyword(install_aiter, function):
    fake = sources("aiter")
    path = "aiter/ops/gemm_op_a8w8.py"
    install_aiter(files={**fake, path: reversed_signature(fake[path], function)})
    assert AITER.problem_for(CALLS["scaled_mm"]) is None
    kwargs = _call(7, 256, 256, "block" if function.endswith("blockscale") else "channel")
    spec.SPEC.check_close(adapter.scaled_mm(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
