"""The fp4_mm spec: its reference against a float64 oracle that decodes nibbles and scales with its
own tables and applies the scales block by block, hand-worked examples, validation, fake,
closeness check, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import fp4_mm as spec_module
from kernelmux.specs.fp4_mm import SPEC
from kernelmux.specs.quantize_mxfp4 import quantize_mxfp4
from kernelmux.specs.quantize_nvfp4 import quantize_nvfp4

reference = SPEC.reference
OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
BLOCK = {"nvfp4": 16, "mxfp4": 32}

# The e2m1 code table, written out: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
E2M1 = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
        0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0}
E2M1.update({code | 0b1000: -value for code, value in list(E2M1.items())})


def _e4m3fn(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _e8m0(code: int) -> float:
    return math.nan if code == 0xFF else 2.0 ** (code - 127)


def _decode_codes(packed: torch.Tensor) -> torch.Tensor:
    """[R, K/2] bytes -> [R, K] float64 unscaled e2m1 values, element 2j from the low nibble."""
    rows, half = packed.shape
    out = torch.zeros(rows, 2 * half, dtype=torch.float64)
    table = torch.tensor([E2M1[c] for c in range(16)], dtype=torch.float64)
    as_int = packed.to(torch.int64)
    out[:, 0::2] = table[as_int % 16]
    out[:, 1::2] = table[as_int // 16]
    return out


def _scales(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    decode = _e4m3fn if fmt == "nvfp4" else _e8m0
    lut = torch.tensor([decode(c) for c in range(256)], dtype=torch.float64)
    return lut[raw.to(torch.int64)]


def _oracle(kwargs):
    """float64: the unscaled code products summed per K block, each partial sum times its two
    block scales, and the global scales divided out of the total."""
    fmt, b = kwargs["fmt"], kwargs["b"]
    block = BLOCK[fmt]
    w4a4 = kwargs["a"].dtype == torch.uint8
    qb, sb = _decode_codes(b), _scales(kwargs["b_scale"], fmt)
    if w4a4:
        qa, sa = _decode_codes(kwargs["a"]), _scales(kwargs["a_scale"], fmt)
    else:
        qa = kwargs["a"].double()
        sa = torch.ones(qa.shape[0], sb.shape[1], dtype=torch.float64)
    m, n, k = qa.shape[0], qb.shape[0], qb.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(k // block):
        cols = slice(kb * block, (kb + 1) * block)
        partial = qa[:, cols] @ qb[:, cols].T
        out += partial * sa[:, kb].unsqueeze(1) * sb[:, kb].unsqueeze(0)
    if fmt == "nvfp4":
        divisor = kwargs["b_global_scale"].double().item()
        if w4a4:
            divisor *= kwargs["a_global_scale"].double().item()
        out = out / divisor
    return out


def _magnitude(kwargs):
    deq_a, deq_b = spec_module.dequantize_operands(
        kwargs["a"], kwargs["b"], kwargs["b_scale"], kwargs["fmt"], kwargs["a_scale"],
        kwargs["b_global_scale"], kwargs["a_global_scale"])
    return deq_a.abs().double() @ deq_b.abs().double().T


def _assert_matches_oracle(kwargs):
    out = reference(**kwargs)
    assert out.dtype == OUT[kwargs["out_dtype"]]
    assert out.shape == (kwargs["a"].shape[0], kwargs["b"].shape[0])
    exact = _oracle(kwargs)
    # One rounding to the output dtype (half an ulp), plus the fp32 reference's own roundings
    # (the per-element division by gs, the fp32 products and sum): 2^-16 of sum |A||B| is far
    # above those and far below a wrong scale or nibble. 2^-25 is half fp16's subnormal step.
    bound = (HALF_ULP[kwargs["out_dtype"]] * exact.abs() * (1 + 2.0**-8)
             + 2.0**-16 * _magnitude(kwargs) + 2.0**-25)
    error = (out.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error / bound {float((error / bound).max()):.3g}"


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_reference_matches_float64_oracle_on_cases(case):
    _assert_matches_oracle(case.build(seed=3))


@given(
    m=st.integers(0, 6),
    n=st.integers(1, 40),
    k_blocks=st.integers(1, 5),
    fmt=st.sampled_from(["nvfp4", "mxfp4"]),
    mode=st.sampled_from(["w4a16", "w4a4"]),
    act_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    out_dtype=st.sampled_from(list(OUT)),
    zero_blocks=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_float64_oracle_on_drawn_shapes(m, n, k_blocks, fmt, mode, act_dtype,
                                                         out_dtype, zero_blocks, seed):
    make = spec_module._maker(m, n, k_blocks * BLOCK[fmt], fmt, mode, act_dtype=act_dtype,
                              out_dtype=out_dtype, zero_blocks=zero_blocks)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    SPEC.validate(**kwargs)
    _assert_matches_oracle(kwargs)
    fake = SPEC.fake(**_to_meta(kwargs))
    assert (fake.shape, fake.dtype) == ((m, n), OUT[out_dtype])


def test_hand_worked_nvfp4_w4a16():
    # K = 32: two blocks of 16. gs = 4.
    # Row 0: every code 2 (1.0); block scales 2 and 0.5 -> elements 0.5 (block 0), 0.125 (block 1).
    # Row 1: byte 0 = 0x1F: element 0 = code 0xF (-6), element 1 = code 0x1 (0.5); byte 15 = 0x70:
    #   element 31 = code 7 (6); block scales 1 and 448 -> -1.5, 0.125, ..., 672.
    # a = [1, 2, 1, 1, ...]: out[0, 0] = 0.5 + 1 + 14 * 0.5 + 16 * 0.125 = 10.5;
    # out[0, 1] = -1.5 + 0.25 + 672 = 670.75 (a swapped nibble order would give 669.125).
    b = torch.zeros(2, 16, dtype=torch.uint8)
    b[0] = 0x22
    b[1, 0], b[1, 15] = 0x1F, 0x70
    b_scale = torch.tensor([[2.0, 0.5], [1.0, 448.0]]).to(torch.float8_e4m3fn)
    a = torch.ones(1, 32, dtype=torch.bfloat16)
    a[0, 1] = 2.0
    out = reference(a, b, b_scale, "nvfp4", None, torch.tensor(4.0), None, "float32")
    assert out.tolist() == [[10.5, 670.75]]
    # bf16 output rounds once: 670.75 -> 672 (8 significant bits).
    out = reference(a, b, b_scale, "nvfp4", None, torch.tensor([4.0]), None, "bfloat16")
    assert out.float().tolist() == [[10.5, 672.0]]


def test_hand_worked_mxfp4_w4a4_and_nan_scale():
    # K = 32, one block. a byte 0 = 0x3A: element 0 = 0xA (-1), element 1 = 0x3 (1.5); scale
    # code 128 (2) -> A = [-2, 3, 0, ...]. b row 0 byte 0 = 0x5C: -2, 3; scale code 125 (1/4) ->
    # [-0.5, 0.75, 0, ...]; out = 1 + 2.25 = 3.25. Row 1: zero codes, scale code 0 (2^-127): 0.
    # Row 2: scale code 0xFF (NaN): the whole column is NaN.
    a = torch.zeros(1, 16, dtype=torch.uint8)
    a[0, 0] = 0x3A
    b = torch.zeros(3, 16, dtype=torch.uint8)
    b[0, 0] = 0x5C
    b[2, 0] = 0x11
    a_scale = torch.tensor([[128]], dtype=torch.uint8)
    b_scale = torch.tensor([[125], [0], [0xFF]], dtype=torch.uint8)
    out = reference(a, b, b_scale, "mxfp4", a_scale, None, None, "float32")
    assert out[0, :2].tolist() == [3.25, 0.0]
    assert math.isnan(out[0, 2].item())


def test_nvfp4_w4a4_divides_both_global_scales():
    # One block: A codes 1.0 * sf 8 / gs 2 = 4; B codes 0.5 * sf 0.25 / gs 0.5 = 0.25; K = 16.
    a = torch.full((1, 8), 0x22, dtype=torch.uint8)
    b = torch.full((1, 8), 0x11, dtype=torch.uint8)
    e4 = torch.float8_e4m3fn
    out = reference(a, b, torch.tensor([[0.25]]).to(e4), "nvfp4", torch.tensor([[8.0]]).to(e4),
                    torch.tensor(0.5), torch.tensor(2.0), "float32")
    assert out.item() == 16 * 4.0 * 0.25


def test_decode_covers_every_code_and_round_trips_the_quantizers():
    packed = torch.arange(256, dtype=torch.uint8).view(1, 256)
    assert torch.equal(spec_module.decode_e2m1(packed).double(), _decode_codes(packed))
    x = torch.randn(6, 96)
    for fmt in ("nvfp4", "mxfp4"):
        q, scale, gs = spec_module.quantize(x, fmt)
        deq = spec_module.dequantize_fp4(q, scale, fmt, gs)
        # Half an e2m1 step is at most a quarter of the block amax (the [4, 6] step of 2 / 6 * 1/2
        # for NVFP4 plus the e4m3 scale rounding; MXFP4's saturation at 6 of up to 8 X).
        blocks = x.view(6, -1, BLOCK[fmt]).abs().amax(-1, keepdim=True)
        err = (deq - x).abs().view(6, -1, BLOCK[fmt])
        assert bool((err <= 0.26 * blocks).all())


def _to_meta(kwargs):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build()
    real = reference(**kwargs)
    fake = SPEC.fake(**_to_meta(kwargs))
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")


def test_check_close_allows_accumulation_order_and_rejects_wrong_scales_and_nibbles():
    kwargs = SPEC.case("gpt_oss_120b_mxfp4_w4a16_m16_n2880_k2880").build()
    expected = reference(**kwargs)
    # Another summation order (float64, then rounded) conforms.
    SPEC.check_close(_oracle(kwargs).to(expected.dtype), expected, kwargs)
    # One e8m0 code off by one in one block of b (a doubled block) does not.
    bad = dict(kwargs, b_scale=kwargs["b_scale"].clone())
    bad["b_scale"][5, 40] += 1
    with pytest.raises(AssertionError, match="elements outside"):
        SPEC.check_close(reference(**bad), expected, kwargs)
    # Nor does reading the high nibble first.
    b = kwargs["b"]
    swapped = dict(kwargs, b=(b >> 4) | (b << 4))
    with pytest.raises(AssertionError, match="elements outside"):
        SPEC.check_close(reference(**swapped), expected, kwargs)
    # Nor an NVFP4 W4A4 output that forgot a's global scale.
    kwargs = SPEC.case("small_nvfp4_w4a4").build()
    expected = reference(**kwargs)
    wrong = dict(kwargs, a_global_scale=torch.tensor(1.0))
    with pytest.raises(AssertionError, match="elements outside"):
        SPEC.check_close(reference(**wrong), expected, kwargs)
    with pytest.raises(AssertionError, match="expected"):
        SPEC.check_close(expected.float(), expected, kwargs)


def test_cases_cover_the_model_shapes_and_tags():
    shapes = {}
    for case in SPEC.cases:
        kwargs = case.build()
        mode = "w4a4" if kwargs["a"].dtype == torch.uint8 else "w4a16"
        shapes[case.name] = (kwargs["fmt"], mode, kwargs["a"].shape[0], kwargs["b"].shape[0],
                             2 * kwargs["b"].shape[1])
        assert case.tags & {"model", "random", "edge"}, case.name
    values = set(shapes.values())
    assert ("mxfp4", "w4a16", 1, 2880, 2880) in values
    assert ("mxfp4", "w4a16", 16, 2880, 2880) in values
    assert ("nvfp4", "w4a4", 16, 4096, 7168) in values
    for fmt in ("nvfp4", "mxfp4"):
        for mode in ("w4a16", "w4a4"):
            assert any(v[:2] == (fmt, mode) for v in values), (fmt, mode)
        assert any(v[0] == fmt and v[4] == BLOCK[fmt] for v in values)  # K = one block
    assert any(v[2] == 0 for v in values) and any(v[2] == 1 for v in values)


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("small_nvfp4_w4a4").build()  # M 9, N 32, K 128, bf16 out
    cost = SPEC.cost(kwargs)
    assert cost.flops == 2 * 9 * 32 * 128
    assert cost.bytes == 9 * 64 + 32 * 64 + 32 * 8 + 9 * 8 + 4 + 4 + 9 * 32 * 2
    kwargs = SPEC.case("small_mxfp4_w4a16").build()  # M 6, N 33, K 96, bf16 a and out
    assert SPEC.cost(kwargs).bytes == 6 * 96 * 2 + 33 * 48 + 33 * 3 + 6 * 33 * 2


E4 = torch.float8_e4m3fn
U8 = torch.uint8


def _good(fmt_="nvfp4", mode="w4a4", **changes):
    fmt = fmt_
    x, w = torch.randn(4, 64), torch.randn(40, 64)
    if fmt == "nvfp4":
        b, b_scale, b_gs = quantize_nvfp4(w)
        a, a_scale, a_gs = quantize_nvfp4(x)
    else:
        (b, b_scale), b_gs = quantize_mxfp4(w), None
        (a, a_scale), a_gs = quantize_mxfp4(x), None
    if mode == "w4a16":
        a, a_scale, a_gs = x.to(torch.bfloat16), None, None
    kwargs = dict(a=a, b=b, b_scale=b_scale, fmt=fmt, a_scale=a_scale, b_global_scale=b_gs,
                  a_global_scale=a_gs, out_dtype="bfloat16")
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "fmt, mode, changes, argument, fragment",
    [
        ("nvfp4", "w4a4", {"a": torch.zeros(4, 32, dtype=torch.float32)}, "a", "dtype in"),
        ("nvfp4", "w4a4", {"a": torch.zeros(4, 32, dtype=torch.int8)}, "a", "dtype in"),
        ("nvfp4", "w4a4", {"a": torch.zeros(4, 64, dtype=U8)}, "a", "shape (M, 32)"),
        ("nvfp4", "w4a16", {"a": torch.zeros(4, 32, dtype=torch.bfloat16)}, "a", "shape (M, 64)"),
        ("nvfp4", "w4a16", {"a": torch.zeros(4, 1, 64, dtype=torch.bfloat16)}, "a", "2-d tensor"),
        ("nvfp4", "w4a4", {"fmt": "mxfp8"}, "fmt", "one of"),
        ("nvfp4", "w4a4", {"b": torch.zeros(40, 32, dtype=E4)}, "b", "dtype in {uint8}"),
        ("nvfp4", "w4a4", {"b": torch.zeros(40, 32, dtype=U8, device="meta")}, "b", "on cpu"),
        ("nvfp4", "w4a16", {"b": torch.zeros(40, 36, dtype=U8),
                            "a": torch.zeros(4, 72, dtype=torch.bfloat16)}, "b", "multiple of 16"),
        ("mxfp4", "w4a16", {"b": torch.zeros(40, 8, dtype=U8),
                            "a": torch.zeros(4, 16, dtype=torch.bfloat16)}, "b", "multiple of 32"),
        ("nvfp4", "w4a4", {"b": torch.zeros(0, 32, dtype=U8)}, "b", "N = b.shape[0] >= 1"),
        ("nvfp4", "w4a4", {"b_scale": torch.zeros(40, 4, dtype=U8)}, "b_scale", "dtype in"),
        ("nvfp4", "w4a4", {"b_scale": torch.zeros(40, 2, dtype=E4)}, "b_scale", "shape (40, 4)"),
        ("nvfp4", "w4a4", {"b_scale": torch.zeros(4, 40, dtype=E4)}, "b_scale", "shape (40, 4)"),
        ("mxfp4", "w4a4", {"b_scale": torch.zeros(40, 2, dtype=E4)}, "b_scale", "dtype in {uint8}"),
        ("mxfp4", "w4a4", {"b_scale": torch.zeros(40, 4, dtype=U8)}, "b_scale", "shape (40, 2)"),
        ("mxfp4", "w4a4", {"b_scale": torch.zeros(80, dtype=U8)}, "b_scale", "2-d tensor"),
        ("nvfp4", "w4a4", {"a_scale": None}, "a_scale", "a tensor for packed"),
        ("nvfp4", "w4a4", {"a_scale": torch.zeros(5, 4, dtype=E4)}, "a_scale", "shape (4, 4)"),
        ("mxfp4", "w4a4", {"a_scale": torch.zeros(4, 2, dtype=E4)}, "a_scale", "dtype in {uint8}"),
        ("nvfp4", "w4a4", {"a_scale": torch.zeros(4, 4, dtype=E4, device="meta")}, "a_scale",
         "on cpu"),
        ("nvfp4", "w4a16", {"a_scale": torch.zeros(4, 4, dtype=E4)}, "a_scale", "None when a is"),
        ("nvfp4", "w4a4", {"b_global_scale": None}, "b_global_scale", "a tensor for nvfp4"),
        ("nvfp4", "w4a16", {"b_global_scale": None}, "b_global_scale", "a tensor for nvfp4"),
        ("nvfp4", "w4a4", {"b_global_scale": torch.ones(2)}, "b_global_scale", "one element"),
        ("nvfp4", "w4a4", {"b_global_scale": torch.ones((), dtype=torch.float64)},
         "b_global_scale", "dtype float32"),
        ("nvfp4", "w4a4", {"b_global_scale": 2.0}, "b_global_scale", "a torch.Tensor"),
        ("nvfp4", "w4a4", {"b_global_scale": torch.ones((), device="meta")}, "b_global_scale",
         "on cpu"),
        ("mxfp4", "w4a4", {"b_global_scale": torch.ones(())}, "b_global_scale", "None for mxfp4"),
        ("nvfp4", "w4a4", {"a_global_scale": None}, "a_global_scale", "nvfp4 W4A4"),
        ("nvfp4", "w4a4", {"a_global_scale": torch.ones(1, 1)}, "a_global_scale", "one element"),
        ("nvfp4", "w4a16", {"a_global_scale": torch.ones(())}, "a_global_scale",
         "None for nvfp4 W4A16"),
        ("mxfp4", "w4a4", {"a_global_scale": torch.ones(())}, "a_global_scale", "None for mxfp4"),
        ("nvfp4", "w4a4", {"out_dtype": "float8"}, "out_dtype", "one of"),
        ("mxfp4", "w4a16", {"out_dtype": torch.float16}, "out_dtype", "one of"),
    ],
)
def test_bad_input_names_the_argument(fmt, mode, changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(fmt, mode, **changes))
    assert info.value.argument == argument
    assert info.value.op == "fp4_mm"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_good_input_passes_and_key_reflects_dispatch_properties(fmt, mode):
    key = SPEC.validate(**_good(fmt, mode))
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.mode, key.fmt, key.n, key.k) == (torch.device("cpu"), mode, fmt, 40, 64)
    assert key.a_dtype == (U8 if mode == "w4a4" else torch.bfloat16)
    assert (key.a_scale_layout is not None) == (mode == "w4a4")
    assert (key.b_global_scale_layout is not None) == (fmt == "nvfp4")
    assert (key.a_global_scale_layout is not None) == (fmt == "nvfp4" and mode == "w4a4")
    assert key != SPEC.validate(**_good(fmt, mode, out_dtype="float32"))
    # M changes per batch: the key holds its class only (M = 4 and 6: class 7; 12: class 15).
    assert key.m_class == 7

    def rows(times, extra):
        kwargs = _good(fmt, mode)
        for name in ("a", "a_scale"):
            if kwargs[name] is not None:
                kwargs[name] = torch.cat([kwargs[name]] * times + [kwargs[name][:extra]])
        return kwargs

    assert key == SPEC.validate(**rows(1, 2))
    assert SPEC.validate(**rows(3, 0)) == key._replace(m_class=15)
    hash(key)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_misaligned_or_strided_view_changes_only_its_layout_field(fmt):
    kwargs = _good(fmt, "w4a16")
    key = SPEC.validate(**kwargs)
    assert key.a_layout == Layout(unit_stride=True, alignment=16)
    # a one element into a wider buffer: rows 65 elements (130 bytes) apart.
    shifted = SPEC.validate(**{**kwargs, "a": torch.zeros(4, 65, dtype=torch.bfloat16)[:, 1:]})
    assert shifted.a_layout == Layout(unit_stride=True, alignment=2)
    assert shifted._replace(a_layout=key.a_layout) == key
    # a column-major view: K is not the contiguous dim.
    strided = SPEC.validate(**{**kwargs, "a": kwargs["a"].T.contiguous().T})
    assert not strided.a_layout.unit_stride
    assert strided._replace(a_layout=key.a_layout) == key
