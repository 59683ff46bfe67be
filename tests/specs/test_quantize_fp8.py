"""The quantize_fp8 spec: its reference against the e4m3 code tables built from the format
definitions, hand-worked vectors, an elementwise oracle, round-trip bounds; validation, fake,
cases and cost."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import quantize_fp8 as spec_module
from kernelmux.specs.quantize_fp8 import SPEC

reference = SPEC.reference


# --- the formats, from their definitions (not from torch's casts) -----------------------------

def _decode(code: int, fmt: str) -> float:
    """Value of an e4m3 byte: 1 sign, 4 exponent, 3 mantissa bits. e4m3fn: bias 7, S.1111.111
    is NaN, no infinities. e4m3fnuz: bias 8, 0x80 is the only NaN, no negative zero."""
    sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 0x7
    bias = 7 if fmt == "e4m3fn" else 8
    if fmt == "e4m3fn" and exponent == 0xF and mantissa == 0x7:
        return math.nan
    if fmt == "e4m3fnuz" and code == 0x80:
        return math.nan
    if exponent == 0:
        value = mantissa / 8 * 2.0 ** (1 - bias)
    else:
        value = (1 + mantissa / 8) * 2.0 ** (exponent - bias)
    return -value if sign else value


def _table(fmt: str):
    """(sorted non-negative values, their codes) of the format's finite non-negative codes."""
    pairs = sorted((_decode(c, fmt), c) for c in range(0x80) if not math.isnan(_decode(c, fmt)))
    return [v for v, _ in pairs], [c for _, c in pairs]


TABLES = {fmt: _table(fmt) for fmt in ("e4m3fn", "e4m3fnuz")}


def _encode(value: float, fmt: str) -> int:
    """Round-to-nearest-even, saturating encoding of a float into the format's byte."""
    values, codes = TABLES[fmt]
    magnitude = min(abs(value), values[-1])
    i = bisect.bisect_left(values, magnitude)
    if i < len(values) and values[i] == magnitude:
        code = codes[i]
    else:
        low, high = values[i - 1], values[i]
        if magnitude - low < high - magnitude:
            code = codes[i - 1]
        elif magnitude - low > high - magnitude:
            code = codes[i]
        else:  # a tie goes to the even mantissa
            code = codes[i - 1] if codes[i - 1] % 2 == 0 else codes[i]
    negative = math.copysign(1.0, value) < 0
    if negative and not (fmt == "e4m3fnuz" and code == 0):  # fnuz has no -0
        code |= 0x80
    return code


def test_format_tables_match_the_definitions():
    assert TABLES["e4m3fn"][0][-1] == 448.0 and TABLES["e4m3fnuz"][0][-1] == 240.0
    assert spec_module.FP8_MAX == {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
    assert _decode(0x01, "e4m3fn") == 2.0**-9 and _decode(0x01, "e4m3fnuz") == 2.0**-10


def _codes(q: torch.Tensor) -> list:
    return q.view(torch.uint8).flatten().tolist()


# --- hand-worked vectors ----------------------------------------------------------------------

def test_e4m3fn_codes_with_unit_scale():
    # amax = 448 makes the per-tensor scale exactly 448 / 448 = 1, so codes are the raw encodings.
    x = torch.tensor([[448.0, -448.0, 1.0, 0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
                       1.0625, 1.1875, -2.0**-12, 0.015625, 240.0]])
    q, scale = reference(x, "per_tensor")
    assert scale.tolist() == [1.0]
    assert _codes(q) == [
        0x7E,  # 448 = 1.75 * 2^8: exponent 15, mantissa 110
        0xFE,  # -448
        0x38,  # 1.0: exponent 7 (bias 7), mantissa 0
        0x00,
        0x80,  # -0.0 keeps its sign
        0x01,  # 2^-9, the smallest subnormal
        0x00,  # 2^-10: a tie between 0 and 2^-9 goes to even (0)
        0x02,  # 1.5 * 2^-9: a tie between 0x01 and 0x02 goes to even (0x02 = 2^-8)
        0x38,  # 1.0625: a tie between 1.0 (0x38) and 1.125 (0x39) goes to even
        0x3A,  # 1.1875: a tie between 1.125 (0x39) and 1.25 (0x3A) goes to even
        0x80,  # -2^-12 rounds to -0
        0x08,  # 2^-6, the smallest normal
        0x77,  # 240 = 1.875 * 2^7
    ]


def test_e4m3fnuz_codes_with_unit_scale():
    x = torch.tensor([[240.0, -240.0, 1.0, -0.0, 2.0**-10, 2.0**-11, 0.5]])
    q, scale = reference(x, "per_tensor", fp8_dtype="e4m3fnuz")
    assert scale.tolist() == [1.0] and q.dtype == torch.float8_e4m3fnuz
    # 240 = 1.875 * 2^7 with bias 8: exponent 15, mantissa 111; 1.0: exponent 8; fnuz has no -0
    # and 2^-11 (half the smallest subnormal) ties to 0.
    assert _codes(q) == [0x7F, 0xFF, 0x40, 0x00, 0x01, 0x00, 0x38]


def test_large_values_land_on_the_max_code():
    # scale = fl(1000 / 448); 1000 / scale is within an ulp of 448 and must give 448, not NaN.
    x = torch.tensor([[1000.0, -1000.0, 500.0]])
    q, scale = reference(x, "per_tensor")
    assert scale.item() == np.float32(1000.0) / np.float32(448.0)
    assert _codes(q)[:2] == [0x7E, 0xFE]
    assert _codes(q)[2] == _encode(float(np.float32(500.0) / np.float32(scale.item())), "e4m3fn")


def test_ue8m0_rounds_the_scale_up_to_a_power_of_two():
    # Row 0: amax 1344 = 3 * 448, scale 3 -> 4; 1344 / 4 = 336 ties between 320 (mantissa 010)
    # and 352 (011): even, so 320 = 0x7A. Row 1: amax 4 * 448, scale 4 stays 4; 1792 / 4 = 448.
    x = torch.tensor([[1344.0, 4.0], [1792.0, -4.0]])
    q, scale = reference(x, "per_token", ue8m0=True)
    assert scale.flatten().tolist() == [4.0, 4.0]
    assert _codes(q) == [0x7A, 0x38, 0x7E, 0xB8]
    _, plain = reference(x, "per_token")
    assert plain.flatten().tolist() == [3.0, 4.0]


def test_round_up_to_power_of_two_is_exact_next_to_powers_of_two():
    values = np.array([3.0, 4.0, 2.0**-9 * (1 + 2.0**-23), 2.0**100 * (1 + 2.0**-23),
                       2.0**-126, 0.75, 2.0**127], dtype=np.float32)
    rounded = spec_module.round_up_to_power_of_two(torch.from_numpy(values))
    expected = []
    for v in values.tolist():
        mantissa, exponent = math.frexp(v)
        expected.append(v if mantissa == 0.5 else 2.0**exponent)
    assert rounded.tolist() == expected
    assert expected[3] == 2.0**101  # where 2 ** ceil(log2(s)) in fp32 would give 2^100


def test_per_group_with_a_short_last_group():
    # K = 200: group 0 holds columns 0..127 (amax 7), group 1 columns 128..199 (amax 2.5).
    x = torch.zeros(2, 200)
    x[0, 5], x[0, 150], x[0, 199] = 7.0, -2.5, 1.0
    x[1, 127], x[1, 128] = 3.0, 0.0  # row 1: group 1 all zero
    q, scale = reference(x, "per_group")
    f32 = np.float32
    floor = max(f32(0.0), f32(1e-4)) / f32(448.0)
    assert scale.tolist() == [[f32(7.0) / f32(448.0), f32(2.5) / f32(448.0)],
                              [f32(3.0) / f32(448.0), floor]]
    codes = q.view(torch.uint8)
    assert codes[0, 5] == 0x7E and codes[0, 150] == 0xFE and codes[1, 127] == 0x7E
    assert codes[0, 199] == _encode(float(f32(1.0) / (f32(2.5) / f32(448.0))), "e4m3fn")
    assert int(codes[1, 128:].count_nonzero()) == 0


def test_all_zero_inputs_get_the_documented_scales():
    zeros = torch.zeros(3, 130, dtype=torch.bfloat16)
    tiny = torch.finfo(torch.float32).tiny
    q, scale = reference(zeros, "per_tensor")
    assert scale.tolist() == [tiny] and int(q.view(torch.uint8).count_nonzero()) == 0
    q, scale = reference(zeros, "per_token")
    assert scale.flatten().tolist() == [tiny] * 3 and int(q.view(torch.uint8).count_nonzero()) == 0
    q, scale = reference(zeros, "per_group", ue8m0=True)
    # 1e-4 / 448 = 2.23e-7 rounds up to 2^-22 (2.38e-7).
    assert scale.flatten().tolist() == [2.0**-22] * 6
    q, scale = reference(zeros[:0], "per_tensor")
    assert q.shape == (0, 130) and scale.tolist() == [tiny]


# --- an elementwise oracle and round-trip bounds on drawn data ---------------------------------

def _oracle(x, granularity, group_size, ue8m0, fmt):
    """quantize_fp8 one scale and one element at a time: numpy fp32 arithmetic, table encoding."""
    f32 = np.float32
    values = x.float().numpy()
    rows, cols = values.shape
    fp8_max = f32(TABLES[fmt][0][-1])

    def finish(amax, floor_amax):
        s = max(amax, f32(1e-4)) / fp8_max if floor_amax else max(amax / fp8_max, f32(2.0**-126))
        if ue8m0:
            mantissa, exponent = math.frexp(float(s))
            s = f32(s if mantissa == 0.5 else 2.0**exponent)
        return f32(s)

    if granularity == "per_tensor":
        scales = np.full((1,), finish(f32(np.abs(values).max(initial=0.0)), False), dtype=np.float32)
        owner = lambda r, c: scales[0]
    elif granularity == "per_token":
        scales = np.array([[finish(f32(np.abs(row).max()), False)] for row in values], dtype=np.float32)
        owner = lambda r, c: scales[r, 0]
    else:
        groups = -(-cols // group_size)
        scales = np.array(
            [[finish(f32(np.abs(row[g * group_size:(g + 1) * group_size]).max()), True)
              for g in range(groups)] for row in values], dtype=np.float32).reshape(rows, groups)
        owner = lambda r, c: scales[r, c // group_size]
    codes = [[_encode(float(f32(values[r, c]) / owner(r, c)), fmt) for c in range(cols)]
             for r in range(rows)]
    return codes, scales


@given(
    rows=st.integers(0, 4),
    cols=st.integers(1, 300),
    granularity=st.sampled_from(spec_module.GRANULARITIES),
    group_size=st.sampled_from([1, 16, 128, 129]),
    ue8m0=st.booleans(),
    fmt=st.sampled_from(["e4m3fn", "e4m3fnuz"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_elementwise_oracle(rows, cols, granularity, group_size, ue8m0, fmt,
                                              dtype, magnitude, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=generator) * magnitude).to(dtype)
    x[:, ::7] = 0.0  # exact zeros too
    q, scale = reference(x, granularity, group_size, ue8m0, fmt)
    codes, scales = _oracle(x, granularity, group_size, ue8m0, fmt)
    assert scale.numpy().tolist() == scales.tolist()
    assert q.view(torch.uint8).tolist() == codes


@pytest.mark.parametrize("fmt, subnormal_step", [("e4m3fn", 2.0**-9), ("e4m3fnuz", 2.0**-10)])
@pytest.mark.parametrize("granularity", spec_module.GRANULARITIES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_round_trip_error_is_at_most_half_an_fp8_ulp(fmt, subnormal_step, granularity, ue8m0):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(64, 1000, generator=generator) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, scale = reference(x, granularity, 128, ue8m0, fmt)
    if granularity == "per_group":
        scale = scale.repeat_interleave(128, dim=1)[:, :1000]
    error = (q.double() * scale.double() - x.double()).abs()
    # Normal codes: half an ulp is 2^-4 of the value's power of two, so <= 2^-4 |x|; subnormal
    # codes: half the subnormal step, times the scale. 2^-20 covers the fp32 division's rounding.
    bound = (2.0**-4 * x.double().abs() + subnormal_step / 2 * scale.double()) * (1 + 2.0**-20)
    assert bool((error <= bound).all()), float((error / bound).max())


# --- the spec's other parts --------------------------------------------------------------------

@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")
    SPEC.validate(**kwargs)
    SPEC.check_close(real, reference(**kwargs), kwargs)


@given(rows=st.integers(0, 5), cols=st.integers(1, 400), group_size=st.integers(1, 200),
       granularity=st.sampled_from(spec_module.GRANULARITIES),
       fmt=st.sampled_from(["e4m3fn", "e4m3fnuz"]))
def test_fake_matches_reference_on_drawn_shapes(rows, cols, group_size, granularity, fmt):
    x = torch.randn(rows, cols)
    real = reference(x, granularity, group_size, False, fmt)
    fake = SPEC.fake(x.to("meta"), granularity, group_size, False, fmt)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_check_close_is_bit_exact_and_names_the_first_mismatch():
    kwargs = SPEC.case("small_per_group_ue8m0").build()
    q, scale = reference(**kwargs)
    SPEC.check_close((q.clone(), scale.clone()), (q, scale), kwargs)
    bumped = q.view(torch.uint8).clone()
    bumped[2, 17] ^= 1  # one code one ulp away
    with pytest.raises(AssertionError, match=r"q: 1 of 2304 .*first at \(2, 17\)"):
        SPEC.check_close((bumped.view(q.dtype), scale), (q, scale), kwargs)
    nudged = scale.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(1.0))
    with pytest.raises(AssertionError, match=r"scale: 1 of 18 .*first at \(1, 2\)"):
        SPEC.check_close((q, nudged), (q, scale), kwargs)
    with pytest.raises(AssertionError, match="float8_e4m3fnuz"):
        SPEC.check_close((q.float().to(torch.float8_e4m3fnuz), scale), (q, scale), kwargs)


def test_cases_cover_the_issue_shapes():
    names = {c.name for c in SPEC.cases}
    assert {f"deepseek_v3_m{m}{u}" for m in (1, 128, 1024) for u in ("", "_ue8m0")} <= names
    assert {"llama3_8b_m1024_per_token", "empty_per_group", "one_token_per_group",
            "k_not_multiple_of_group", "zero_rows_per_group", "extremes_per_token"} <= names
    assert SPEC.cases_tagged("quick") and SPEC.cases_tagged("random") and SPEC.cases_tagged("edge")


def test_extremes_case_saturates_to_the_max_code():
    kwargs = SPEC.case("extremes_per_token").build()
    q, _ = reference(**kwargs)
    assert q.view(torch.uint8)[:, 0].tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0xFE]


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("deepseek_v3_m128").build()
    cost = SPEC.cost(kwargs)
    assert cost.bytes == 128 * 7168 * 2 + 128 * 7168 + 128 * 56 * 4
    assert cost.flops > 0


def _good(**changes):
    kwargs = dict(x=torch.randn(4, 256), granularity="per_group", group_size=128, ue8m0=False,
                  fp8_dtype="e4m3fn")
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"x": torch.zeros(4, 256, dtype=torch.float64)}, "x", "dtype in"),
        ({"x": torch.zeros(4, 256, dtype=torch.float8_e4m3fn)}, "x", "dtype in"),
        ({"x": torch.zeros(2, 4, 256)}, "x", "2-d tensor"),
        ({"x": [[0.0] * 4]}, "x", "torch.Tensor"),
        ({"x": torch.zeros(4, 0)}, "x", "K = x.shape[1] >= 1"),
        ({"granularity": "per_block"}, "granularity", "one of"),
        ({"group_size": 0}, "group_size", ">= 1"),
        ({"group_size": 128.0}, "group_size", "a Python int"),
        ({"ue8m0": 1}, "ue8m0", "a bool"),
        ({"fp8_dtype": "e5m2"}, "fp8_dtype", "one of"),
        ({"fp8_dtype": torch.float8_e4m3fn}, "fp8_dtype", "one of"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "quantize_fp8"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.x_dtype, key.granularity, key.group_size, key.k) == (
        torch.device("cpu"), torch.float32, "per_group", 128, 256)
    assert key != SPEC.validate(**_good(x=torch.randn(4, 256, dtype=torch.bfloat16)))
    assert SPEC.validate(**_good(ue8m0=True)) == key._replace(ue8m0=True)
    assert SPEC.validate(**_good(group_size=64)) == key._replace(group_size=64)
    assert SPEC.validate(**_good(fp8_dtype="e4m3fnuz")) == key._replace(fp8_dtype="e4m3fnuz")
    # M changes per batch: the key holds its class only (M = 4 and 7: class 7; 9: class 15).
    assert key.m_class == 7
    assert key == SPEC.validate(**_good(x=torch.randn(7, 256)))
    assert SPEC.validate(**_good(x=torch.randn(9, 256))) == key._replace(m_class=15)
    # group_size does not matter (and is not in the key) for the other granularities.
    assert SPEC.validate(**_good(granularity="per_token")).group_size is None
    assert SPEC.validate(**_good(granularity="per_token")) == SPEC.validate(
        **_good(granularity="per_token", group_size=64))
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_the_layout_field():
    key = SPEC.validate(**_good())
    assert key.x_layout == Layout(unit_stride=True, alignment=16)
    # x one element into a wider buffer: rows 257 fp32 (1028 bytes) apart.
    shifted = SPEC.validate(**_good(x=torch.randn(4, 257)[:, 1:]))
    assert shifted.x_layout == Layout(unit_stride=True, alignment=4)
    assert shifted._replace(x_layout=key.x_layout) == key
    # a column-major view: K is not the contiguous dim.
    strided = SPEC.validate(**_good(x=torch.randn(256, 4).T))
    assert not strided.x_layout.unit_stride
    assert strided._replace(x_layout=key.x_layout) == key
