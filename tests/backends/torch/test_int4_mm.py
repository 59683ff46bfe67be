"""The torch backend's int4_mm (KleidiAI through aten::_dyn_quant_pack_4bit_weight and
aten::_dyn_quant_matmul_4bit): on this machine the same ops run torch's reference path, so the adapter
runs here against the spec's reference on fresh inputs, strided and sliced views, empty batches and
the spec's cases; its declines by name, its keyword calls, its static check and its selection on a
simulated aarch64. KleidiAI's own kernels run only on an Arm CPU (conformance runs them there)."""

from __future__ import annotations

import os

import pytest
import torch

from fakes import ask
from kernelmux.backends._vendor import VendorCall
from kernelmux.backends.torch import _torch_api
from kernelmux.backends.torch import int4_mm as impl
from kernelmux.engine import Engine, FallbackWarning, Settings
from kernelmux.platforms import Feature, Platform, PlatformKind, simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import int4_mm as spec

ARM = simulate("aarch64")
ON_KLEIDIAI = getattr(torch.backends, "kleidiai", None) is not None and torch.backends.kleidiai.is_available()


def _build(make, seed: int) -> dict:
    return make(torch.device("cpu"), torch.Generator().manual_seed(seed))


def _check(kwargs: dict, seed: int) -> torch.Tensor:
    assert ask(impl.supports, spec.SPEC, kwargs, ARM) is None
    expected = spec.SPEC.reference(**kwargs)
    actual = impl.int4_mm(**kwargs)
    try:
        spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None
    return actual


# ---------------------------------------------------------------------------------------------
# What it declines, and why

@pytest.mark.parametrize("make, reason", [
    (spec._maker(4, 16, 64, 32, act_quant="none"), "act_quant 'int8_dynamic' only"),
    (spec._maker(4, 16, 64, 64, act_dtype=torch.bfloat16, act_quant="none"), "act_quant 'int8_dynamic' only"),
    (spec._maker(3, 16, 128, 32, scale_dtype=torch.float32), "bfloat16 group scales only"),
    (spec._maker(3, 16, 128, 64, scale_dtype=torch.float16), "bfloat16 group scales only"),
    (spec._maker(3, 16, 64, 16), "groups that are multiples of 32 only"),
    (spec._maker(3, 16, 96, 48), "groups that are multiples of 32 only"),
], ids=["w4a16", "w4a16_channelwise", "fp32_group_scales", "fp16_group_scales", "group_16", "group_48"])
def test_declines_by_name(make, reason):
    answer = ask(impl.supports, spec.SPEC, _build(make, 0), ARM)
    assert answer is not None and reason in answer, answer


@pytest.mark.parametrize("make", [
    spec._maker(3, 16, 96, 96, scale_dtype=torch.float16),  # per channel: fp16 widens to fp32 exactly
    spec._maker(3, 16, 96, 96, scale_dtype=torch.bfloat16),
    spec._maker(3, 16, 40, 40),  # K 40: per channel, K not a multiple of 32
    spec._maker(4, 16, 256, 64, act_dtype=torch.bfloat16),  # bf16 groups: torch's bf16 path has none
    spec._maker(4, 16, 128, 128, act_dtype=torch.float16, with_bias=True),
], ids=["fp16_channel_scales", "bf16_channel_scales", "k_40", "bf16_acts_groupwise", "fp16_acts_bias"])
def test_takes(make):
    assert ask(impl.supports, spec.SPEC, _build(make, 0), ARM) is None


def test_takes_every_w4a8_model_case():
    for case in spec.SPEC.cases:
        if "model" in case.tags and "w4a16" not in case.name:
            assert ask(impl.supports, spec.SPEC, case.build("cpu", 0), ARM) is None, case.name


# ---------------------------------------------------------------------------------------------
# Against the reference, on torch's reference path here (KleidiAI's kernels on an Arm CPU)

@pytest.mark.parametrize("case", [c for c in spec.SPEC.cases if c.tags & {"random", "edge", "quick"}],
                         ids=lambda c: c.name)
def test_cases_match_the_reference(case):
    seed = int.from_bytes(os.urandom(4), "little")
    kwargs = case.build("cpu", seed)
    reason = ask(impl.supports, spec.SPEC, kwargs, ARM)
    if reason is not None:
        pytest.skip(f"declined: {reason}")
    _check(kwargs, seed)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rows, channels, cols, group, act_dtype, bias", [
    (9, 48, 256, 32, torch.float32, False),
    (5, 33, 192, 192, torch.float32, True),     # per channel, odd N, a bias
    (3, 20, 128, 64, torch.bfloat16, True),     # bf16 through the fp32 route, rounded once
    (7, 8, 96, 96, torch.float16, False),
    (1, 64, 512, 128, torch.float32, True),     # one decode token
])
def test_fresh_inputs_match_the_reference(seed, rows, channels, cols, group, act_dtype, bias):
    make = spec._maker(rows, channels, cols, group, act_dtype=act_dtype, with_bias=bias)
    _check(_build(make, 100 * seed + rows), seed)


@pytest.mark.skipif(ON_KLEIDIAI, reason="KleidiAI's kernels sum in another order: check_close covers them")
@pytest.mark.parametrize("name", ["small_g32", "small_channelwise_bias", "special_rows_g32",
                                  "special_rows_channelwise_bias", "llama3_8b_o_proj_m1_g32"])
def test_reference_path_is_bit_identical_in_fp32(name):
    # torch's reference path (every CPU without KleidiAI) computes what the spec's reference
    # does, rounding for rounding: a regression in either shows here first.
    kwargs = spec.SPEC.case(name).build("cpu", 7)
    assert torch.equal(impl.int4_mm(**kwargs), spec.SPEC.reference(**kwargs))


def _wider(t: torch.Tensor, extra: int, offset: int = 0) -> torch.Tensor:
    """``t`` as a view of a wider buffer: rows ``extra`` elements longer, starting at ``offset``."""
    wide = torch.zeros(t.shape[0], t.shape[1] + extra, dtype=t.dtype)
    wide[:, offset:offset + t.shape[1]] = t
    return wide[:, offset:offset + t.shape[1]]


def _every_other_column(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    wide[:, ::2] = t
    return wide[:, ::2]


@pytest.mark.parametrize("view", ["a_row_strided", "a_misaligned", "a_every_other_column", "a_row_slice",
                                  "b_row_strided", "b_scale_column_major", "bias_strided", "all"])
def test_strided_and_sliced_inputs(view):
    # torch's op reads its input by data pointer as dense rows (a strided view gave wrong rows on
    # torch 2.13): the adapter hands it dense copies of whatever the caller passes.
    kwargs = _build(spec._maker(6, 40, 128, 32, with_bias=True), 11)
    bias = kwargs["bias"]
    if view in ("a_row_strided", "all"):
        kwargs["a"] = _wider(kwargs["a"], 64)
    if view == "a_misaligned":
        kwargs["a"] = _wider(kwargs["a"], 3, offset=1)
    if view == "a_every_other_column":
        kwargs["a"] = _every_other_column(kwargs["a"])
    if view == "a_row_slice":
        kwargs["a"] = torch.cat([torch.randn(3, 128), kwargs["a"]])[3:]
    if view in ("b_row_strided", "all"):
        kwargs["b"] = _wider(kwargs["b"], 16)
    if view in ("b_scale_column_major", "all"):
        kwargs["b_scale"] = kwargs["b_scale"].t().contiguous().t()
    if view in ("bias_strided", "all"):
        kwargs["bias"] = torch.stack([bias, torch.full_like(bias, 1e6)], dim=1)[:, 0]
    assert any(not t.is_contiguous() or t.storage_offset()
               for t in (kwargs["a"], kwargs["b"], kwargs["b_scale"], kwargs["bias"]))
    _check(kwargs, 11)


@pytest.mark.parametrize("make", [spec._maker(0, 64, 128, 32), spec._maker(0, 16, 64, 64, act_dtype=torch.bfloat16,
                                                                             with_bias=True)])
def test_empty_batch(make):
    kwargs = _build(make, 0)
    out = _check(kwargs, 0)
    assert out.shape == (0, kwargs["b"].shape[0]) and out.dtype == kwargs["a"].dtype
    assert impl.metadata(kwargs) is None  # nothing to pack for no rows


def test_metadata_is_the_weight_packing():
    kwargs = _build(spec._maker(4, 24, 128, 32, with_bias=True), 3)
    packed = impl.metadata(kwargs)
    assert torch.equal(packed, impl.pack_weights(kwargs["b"], kwargs["b_scale"], 32, kwargs["bias"]))
    out = torch.ops.aten._dyn_quant_matmul_4bit(inp=kwargs["a"], packed_weights=packed, block_size=32,
                                                in_features=128, out_features=24)
    assert torch.equal(out, impl.int4_mm(**kwargs))


def test_calls_the_ops_by_keyword(monkeypatch):
    # Both ops re-registered with their parameters in reverse order, keyword-only: a positional
    # call would raise TypeError, a wrong name would too.
    pack, matmul = torch.ops.aten._dyn_quant_pack_4bit_weight, torch.ops.aten._dyn_quant_matmul_4bit
    calls = []

    def reordered_pack(*, out_features, in_features, block_size, bias, scales_zeros, weights):
        calls.append(("pack", weights.dtype, scales_zeros.dtype, None if bias is None else bias.dtype))
        return pack(weights, scales_zeros, bias, block_size, in_features, out_features)

    def reordered_matmul(*, out_features, in_features, block_size, packed_weights, inp):
        calls.append(("matmul", inp.dtype, inp.is_contiguous()))
        return matmul(inp, packed_weights, block_size, in_features, out_features)

    monkeypatch.setattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight", reordered_pack)
    monkeypatch.setattr(torch.ops.aten, "_dyn_quant_matmul_4bit", reordered_matmul)
    for make in (spec._maker(3, 16, 128, 32, act_dtype=torch.bfloat16, with_bias=True),
                 spec._maker(3, 16, 64, 64, scale_dtype=torch.float16)):
        _check(_build(make, 5), 5)
    # Groups keep bf16 scales; per channel they are widened to fp32; activations and bias go as fp32.
    assert calls == [("pack", torch.uint8, torch.bfloat16, torch.float32), ("matmul", torch.float32, True),
                     ("pack", torch.uint8, torch.float32, None), ("matmul", torch.float32, True)]


# ---------------------------------------------------------------------------------------------
# The static check, and selection

def test_static_check_takes_this_torch_on_a_simulated_arm():
    assert _torch_api.kleidiai_problem(ARM) is None


def test_static_check_on_real_arm_asks_whether_torch_has_kleidiai(monkeypatch):
    real_arm = Platform(PlatformKind.CPU, "aarch64", None, frozenset({Feature.KLEIDIAI}), "Neoverse-V2")
    if ON_KLEIDIAI:
        assert _torch_api.kleidiai_problem(real_arm) is None
    else:
        assert "built without KleidiAI" in _torch_api.kleidiai_problem(real_arm)
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: True)
    assert _torch_api.kleidiai_problem(real_arm) is None
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: False)
    assert "is_available() is False" in _torch_api.kleidiai_problem(real_arm)


def test_static_check_names_a_missing_op_or_keyword(monkeypatch):
    missing = VendorCall("torch", "ops.aten._dyn_quant_matmul_8bit", ("inp",))
    monkeypatch.setattr(_torch_api, "INT4_CALLS", (_torch_api.INT4_CALLS[0], missing))
    reason = _torch_api.kleidiai_problem(ARM)
    assert f"torch {torch.__version__}" in reason and "_dyn_quant_matmul_8bit" in reason
    renamed = VendorCall("torch", "ops.aten._dyn_quant_matmul_4bit", ("input", "packed_weights"))
    monkeypatch.setattr(_torch_api, "INT4_CALLS", (renamed,))
    assert "takes no keyword input" in _torch_api.kleidiai_problem(ARM)


def test_selected_on_a_simulated_arm_and_rejected_elsewhere():
    engine = Engine(ALL_SPECS, Settings(platform="aarch64"))
    first = engine.tables["int4_mm"].candidates[0].impl
    assert (first.backend, first.fn, first.supports) == ("torch", impl.int4_mm, impl.supports)
    assert first.devices == frozenset({"cpu"}) and first.priority > 10  # above the cpu backend
    kwargs = spec.SPEC.case("small_g32").build("cpu", 1)
    assert engine.resolve("int4_mm", **kwargs) is impl.int4_mm
    spec.SPEC.check_close(engine.dispatchers["int4_mm"](**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    # W4A16 and fp32 group scales fall through to the reference.
    w4a16 = spec.SPEC.case("small_w4a16_g32").build("cpu", 1)
    with pytest.warns(FallbackWarning, match="act_quant 'int8_dynamic' only"):
        assert engine.resolve("int4_mm", **w4a16) is spec.SPEC.reference
    for platform, reason in (("x86_64", "needs arch in {aarch64}"), ("aarch64-kleidiai", "needs features kleidiai"),
                             ("sm_90", "needs a cpu platform")):
        rejected = {i.backend: r for i, r in Engine(ALL_SPECS, Settings(platform=platform)).tables["int4_mm"].rejected}
        assert reason in rejected["torch"], rejected
