"""The cpu backend's fused_moe against the spec's reference: every named case on seeds of its own,
drawn shapes with both matmul routes forced and the conversion chunk shrunk, inputs of any strides,
empty and all-off-rank batches, and the fp8 and fp4 dequantization bit for bit. The named cases also run in
tests/backends/test_conformance.py."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelmux
from kernelmux.backends.cpu import _fp4 as fp4
from kernelmux.backends.cpu import fused_moe as impl
from kernelmux.specs import fused_moe as spec

# The four model cases' references take 0.1-1 s each on the 2-core VM: one seed each; the small
# ones three.
MODEL = [c.name for c in spec.SPEC.cases if "model" in c.tags]
SMALL = [c.name for c in spec.SPEC.cases if "model" not in c.tags]
ROUTES = {
    "default": {},
    # Every expert through fp32 chunks, each chunk one 128-row block: a partial last chunk, and
    # fp8_block scale rows found from the chunk's first row.
    "chunked": {"_DIRECT_MAX_ROWS": 0, "_CHUNK_ELEMENTS": 1},
    # Every unquantized expert through the GEMM in the weights' dtype, however many rows.
    "direct": {"_DIRECT_MAX_ROWS": 1 << 30},
}


def _route(name: str, routes: dict = ROUTES):
    return mock.patch.multiple(impl, **routes[name]) if routes[name] else contextlib.nullcontext()


def _build(make, seed: int) -> dict:
    return make(torch.device("cpu"), torch.Generator().manual_seed(seed))


def _check(kwargs: dict, what: str) -> None:
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    expected = spec.SPEC.reference(**ref_kwargs)
    actual = impl.fused_moe(**kwargs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    try:
        spec.SPEC.check_close(actual, expected, ref_kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("name, seed", [(n, 101) for n in MODEL] + [(n, s) for n in SMALL for s in (5, 6, 7)])
def test_named_cases(name, seed):
    _check(spec.SPEC.case(name).build("cpu", seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("route", ["chunked", "direct"])
@pytest.mark.parametrize("name", SMALL)
def test_named_cases_on_each_route(name, route):
    with _route(route):
        _check(spec.SPEC.case(name).build("cpu", 17), f"{name}, {route}")


@settings(deadline=None, max_examples=40)
@given(case=spec.SPEC.shapes(), route=st.sampled_from(sorted(ROUTES)), seed=st.integers(0, 2**31 - 1))
def test_drawn_shapes(case, route, seed):
    with _route(route):
        _check(case.build("cpu", seed), f"{case.name}, {route}, seed {seed}")


# ---------------------------------------------------------------------------------------------
# Inputs of any strides: each view holds the case's values with garbage (NaN, or huge ids) in the
# memory it skips, so a reader that assumes dense rows reads garbage.

def _column_slice(tensor: torch.Tensor, garbage) -> torch.Tensor:
    """``tensor`` [R, C] as columns 3..3+C of a wider tensor."""
    wide = torch.full((tensor.shape[0], tensor.shape[1] + 5), garbage, dtype=tensor.dtype)
    wide[:, 3:3 + tensor.shape[1]] = tensor
    return wide[:, 3:3 + tensor.shape[1]]


def _every_other_expert(w: torch.Tensor) -> torch.Tensor:
    """``w`` [E, N, K] as the even experts of a [2E, N, K] tensor (odd ones NaN)."""
    doubled = torch.full((2 * w.shape[0], *w.shape[1:]), float("nan"), dtype=torch.float32).to(w.dtype)
    doubled[::2] = w
    return doubled[::2]


def _column_major(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored transposed."""
    return tensor.transpose(-2, -1).contiguous().transpose(-2, -1)


def _strided(kwargs: dict) -> dict:
    out = dict(kwargs)
    out["hidden"] = _column_slice(kwargs["hidden"], float("nan"))
    out["w1"] = _every_other_expert(kwargs["w1"])
    out["w2"] = _column_major(kwargs["w2"])
    out["topk_ids"] = kwargs["topk_ids"].t().contiguous().t()
    out["topk_weights"] = _column_slice(kwargs["topk_weights"], float("nan"))
    if kwargs["expert_map"] is not None:
        doubled = torch.full((2 * kwargs["expert_map"].numel(),), 1 << 20, dtype=torch.int32)
        doubled[::2] = kwargs["expert_map"]
        out["expert_map"] = doubled[::2]
    for name in ("w1_scale", "w2_scale", "w1_global_scale", "w2_global_scale"):
        if kwargs.get(name) is not None:
            out[name] = _column_major(kwargs[name]) if kwargs[name].dim() == 3 else _every_other_expert(
                kwargs[name].view(-1, 1, 1)).view(-1)
    return out


STRIDED_CASES = ["small_silu", "small_gelu_fp16", "expert_map_with_holes", "top1_weight_on_input",
                 "small_fp8_per_tensor", "expert_map_holes_fp8_per_tensor", "small_fp8_block",
                 "small_fp8_block_fnuz_gelu", "fp8_block_h_i_not_multiple_of_128", "small_mxfp4",
                 "small_nvfp4_gelu_fp16"]


@pytest.mark.parametrize("route", ["default", "chunked"])
@pytest.mark.parametrize("name", STRIDED_CASES)
def test_inputs_of_any_strides(name, route):
    kwargs = spec.SPEC.case(name).build("cpu", 23)
    strided = _strided(kwargs)
    changed = [k for k, v in strided.items() if isinstance(v, torch.Tensor) and not v.is_contiguous()]
    # A [T, 1] transposed copy is still contiguous (top-1 cases).
    wanted = {"hidden", "w1", "w2", "topk_weights"}
    if kwargs["topk_ids"].shape[1] > 1:
        wanted.add("topk_ids")
    assert wanted <= set(changed), changed
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    expected = spec.SPEC.reference(**ref_kwargs)
    with _route(route):
        actual = impl.fused_moe(**strided)
    spec.SPEC.check_close(actual, expected, ref_kwargs)


def test_weights_stored_column_major_on_the_direct_route():
    # w1 stored [E, H, 2I]: the GEMM in the weights' dtype then reads a row-major W1[e].T, another
    # BLAS layout than the usual one.
    kwargs = _build(spec._maker(3, 8, 2, 96, 64), 2)
    kwargs["w1"] = _column_major(kwargs["w1"])
    with _route("direct"):
        _check(kwargs, "w1 column-major, direct route")


# ---------------------------------------------------------------------------------------------
# Edges

@pytest.mark.parametrize("quantization", ["none", "fp8_block"])
def test_empty_batch(quantization):
    kwargs = _build(spec._maker(0, 4, 2, 128, 128, quantization=quantization, dtype=torch.float16), 0)
    out = impl.fused_moe(**kwargs)
    assert out.shape == (0, 128) and out.dtype == torch.float16


@pytest.mark.parametrize("quantization", ["none", "fp8_per_tensor"])
def test_every_pair_off_rank_gives_zeros(quantization):
    kwargs = _build(spec._maker(5, 8, 2, 64, 32, local_experts=2, quantization=quantization), 3)
    kwargs["expert_map"] = torch.full_like(kwargs["expert_map"], -1)
    out = impl.fused_moe(**kwargs)
    assert out.shape == (5, 64) and out.dtype == torch.bfloat16 and bool((out == 0).all())


def test_a_nan_weight_code_poisons_only_its_experts_tokens():
    # e4m3fnuz's only NaN code (0x80) in expert 0's w2: the tokens routed to expert 0 come out
    # NaN (as the reference's), the others finite.
    kwargs = _build(spec._maker(6, 3, 1, 64, 32, quantization="fp8_per_tensor", fp8_name="e4m3fnuz"), 9)
    kwargs["w2"].view(torch.uint8)[0, 5, 7] = 0x80
    expected = spec.SPEC.reference(**kwargs)
    actual = impl.fused_moe(**kwargs)
    hit = kwargs["topk_ids"][:, 0] == 0
    assert bool(hit.any()) and bool((~hit).any())
    assert torch.equal(actual.isnan().any(dim=1), hit) and torch.equal(expected.isnan().any(dim=1), hit)


# ---------------------------------------------------------------------------------------------
# fp8 weights with a scale per block

def _varied_weights(experts: int, rows: int, cols: int, quantization: str, fp8_name: str, seed: int):
    """fp8 codes and scales of [experts, rows, cols] weights whose magnitudes vary by up to 16x from
    row to row and column to column, so every 128 x 128 block has a scale of its own (the spec's
    cases vary them per expert only): a block's scale applied to another's codes is caught."""
    generator = torch.Generator().manual_seed(seed)
    w = spec._weights(experts, rows, cols, torch.float32, generator)
    w = w * 2.0 ** torch.randint(-2, 3, (experts, rows, 1), generator=generator)
    w = w * 2.0 ** torch.randint(-2, 3, (experts, 1, cols), generator=generator)
    w = w * (torch.rand(cols, generator=generator) + 0.5)
    return spec._quantize_weights(w.to(torch.bfloat16), quantization, fp8_name)


@pytest.mark.parametrize("quantization, fp8_name", [("fp8_block", "e4m3fn"), ("fp8_block", "e4m3fnuz"),
                                                    ("fp8_per_tensor", "e4m3fn")])
@pytest.mark.parametrize("route", ["default", "chunked"])
@pytest.mark.parametrize("tokens, hidden_size, inter_size", [(7, 384, 256), (5, 200, 300)])
def test_weights_with_a_scale_per_block(quantization, fp8_name, route, tokens, hidden_size, inter_size):
    make = spec._maker(tokens, 4, 2, hidden_size, inter_size, quantization=quantization, fp8_name=fp8_name)
    kwargs = _build(make, tokens)
    kwargs["w1"], kwargs["w1_scale"] = _varied_weights(4, 2 * inter_size, hidden_size, quantization,
                                                       fp8_name, 1)
    kwargs["w2"], kwargs["w2_scale"] = _varied_weights(4, hidden_size, inter_size, quantization, fp8_name, 2)
    with _route(route):
        _check(kwargs, f"{quantization} {fp8_name}, {route}")


# ---------------------------------------------------------------------------------------------
# The fp8 dequantization, exactly: the chunked GEMM against an identity input returns W itself, and
# the all-experts-at-once route returns every W; each must equal the reference's _dequantize_weight
# bit for bit (every chunk boundary and short block included).

@pytest.mark.parametrize("fp8_name", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("quantization, rows, cols", [
    ("fp8_per_tensor", 300, 64), ("fp8_block", 300, 200), ("fp8_block", 256, 384), ("fp8_block", 40, 72),
])
@pytest.mark.parametrize("chunk", [1, impl._CHUNK_ELEMENTS])
def test_dequantized_weights_are_the_references_bit_for_bit(fp8_name, quantization, rows, cols, chunk):
    codes, scales = _varied_weights(3, rows, cols, quantization, fp8_name, rows + cols)
    with mock.patch.object(impl, "_CHUNK_ELEMENTS", chunk):
        got = impl._chunked_gemm(torch.eye(cols), codes[1], scales, quantization, 1)
    assert torch.equal(got.T, spec._dequantize_weight(codes, scales, 1, quantization))
    every = impl._dequantize(codes.reshape(-1, cols), impl._row_scales(scales, quantization, rows),
                             torch.empty(codes.numel())).view(codes.shape)
    for expert in range(3):
        want = spec._dequantize_weight(codes, scales, expert, quantization)
        assert torch.equal(every[expert], want), expert


# fp4: the chunked decode against an identity input returns each expert's W, which must equal the
# reference's bit for bit, for every byte and every finite scale code: e8m0 0 (2^-127) to 252 (253 and
# 254 overflow 6 x 2^k to inf, and 0 x inf in the identity product is NaN), e4m3fn subnormals,
# negatives and 448, with chunks of one row and of many. A NaN scale (e8m0 0xFF) makes its row NaN.

@pytest.mark.parametrize("quantization", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("chunk", [1, impl._CHUNK_ELEMENTS])
def test_fp4_weights_decode_to_the_references_bit_for_bit(quantization, chunk):
    generator = torch.Generator().manual_seed(11)
    experts, rows, cols = 2, 256, 128
    block = spec.FP4_BLOCKS[quantization]
    codes = torch.arange(experts * rows * cols // 2, dtype=torch.int32).remainder(256).to(torch.uint8)
    codes = codes.view(experts, rows, cols // 2)  # every byte, many times
    scale_codes = torch.randint(0, 253, (experts, rows, cols // block), generator=generator, dtype=torch.uint8)
    if quantization == "mxfp4":
        scale_codes.view(-1)[:253] = torch.arange(253, dtype=torch.int32).to(torch.uint8)
        scales, global_scale = scale_codes, None
    else:  # e4m3fn codes without NaN (0x7F, 0xFF): subnormals, negatives and the largest included
        nan = (scale_codes & 0x7F) == 0x7F
        scales = torch.where(nan, scale_codes - 1, scale_codes).view(torch.float8_e4m3fn)
        global_scale = torch.rand(experts, generator=generator) * 1000 + 1
    eye = torch.eye(cols)
    every = fp4.decode_experts(codes, scales, global_scale, quantization)  # small weights' route
    for expert in range(experts):
        got = fp4.gemm(eye, codes[expert], scales[expert], global_scale[expert] if global_scale is not None else None,
                       quantization, chunk).T
        want = spec._dequantize_weight(codes, scales, expert, quantization, global_scale)
        assert torch.equal(got, want), expert  # x * 1 + 0 keeps every value
        assert torch.equal(every[expert], want), expert
    if quantization == "mxfp4":
        scales = scales.clone()
        scales[0, 5, 1] = 0xFF
        got = fp4.gemm(torch.eye(cols), codes[0], scales[0], None, quantization, chunk).T
        assert got[5].isnan().all() and not got[torch.arange(rows) != 5].isnan().any()
        every = fp4.decode_experts(codes, scales, None, quantization)[0]
        nan = torch.zeros(rows, cols, dtype=torch.bool)
        nan[5, 32:64] = True  # the block of scale [5, 1] only
        assert torch.equal(every.isnan(), nan)


# fp4 end to end, both formats in both hidden dtypes and activations, experts on other ranks: every
# expert decoded at once (default), or one expert at a time in chunks of one row (chunked) or of
# several with a short last one (2I = 128 rows of H = 96: chunks of 10; H = 96 rows of I = 64: of 15),
# with 1 (a GEMV), 5-6 (padded to 16) or 18-22 rows per expert.
FP4_ROUTES = {**ROUTES, "fp4_chunks": {"_CHUNK_ELEMENTS": 1000}}


@pytest.mark.parametrize("route", ["default", "chunked", "fp4_chunks"])
@pytest.mark.parametrize("dtype, activation", [(torch.bfloat16, "silu"), (torch.bfloat16, "gelu"),
                                               (torch.float16, "silu"), (torch.float16, "gelu")])
@pytest.mark.parametrize("quantization", ["mxfp4", "nvfp4"])
def test_fp4_experts_end_to_end(quantization, dtype, activation, route):
    for tokens, experts, topk in ((3, 8, 1), (12, 6, 3), (40, 6, 3)):
        make = spec._maker(tokens, experts, topk, 96, 64, dtype=dtype, activation=activation,
                           quantization=quantization, unmapped=2)
        kwargs = _build(make, tokens)
        with _route(route, FP4_ROUTES):
            _check(kwargs, f"{quantization} {dtype} {activation}, {route}, T {tokens}")


@pytest.mark.parametrize("route", ["default", "chunked"])
def test_a_nan_mxfp4_scale_poisons_only_its_experts_tokens(route):
    # e8m0 code 0xFF (NaN) for one block of expert 0's w2: the tokens routed to expert 0 come out NaN
    # in that output column, as the reference's; every other output is finite.
    kwargs = _build(spec._maker(6, 3, 1, 64, 32, quantization="mxfp4"), 9)
    kwargs["w2_scale"][0, 5, 0] = 0xFF
    expected = spec.SPEC.reference(**kwargs)
    with _route(route):
        actual = impl.fused_moe(**kwargs)
    hit = kwargs["topk_ids"][:, 0] == 0
    assert bool(hit.any()) and bool((~hit).any())
    nan = torch.zeros(actual.shape, dtype=torch.bool)
    nan[hit, 5] = True
    assert torch.equal(actual.isnan(), nan) and torch.equal(expected.isnan(), nan)


def test_dispatch_chooses_cpu_for_cpu_tensors():
    engine = kernelmux.configure(from_env=False)
    try:
        kwargs = spec.SPEC.case("small_fp8_block").build("cpu", 0)
        assert engine.resolve("fused_moe", **kwargs) is impl.fused_moe
    finally:
        kernelmux.reset()
