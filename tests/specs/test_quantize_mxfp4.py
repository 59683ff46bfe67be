"""The quantize_mxfp4 spec: its reference against the e2m1 code table and e8m0 scale rules from
OCP MX v1.0, hand-worked vectors for both scale roundings and the exponent clamp, an independent
scalar oracle, round-trip bounds; validation, fake, cases and cost."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import quantize_mxfp4 as spec_module
from kernelmux.specs.quantize_mxfp4 import SPEC
from fp4_layouts import swizzled_by_loop

reference = SPEC.reference
f32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_encode(value: float) -> int:
    """Nearest e2m1 code, a tie to the even code, saturating at 6; sign from the value."""
    magnitude = min(abs(value), 6.0)
    i = bisect.bisect_left(E2M1, magnitude)
    if E2M1[i] != magnitude:
        low, high = magnitude - E2M1[i - 1], E2M1[i] - magnitude
        i = (i - 1 if low < high else i) if low != high else (i - 1 if (i - 1) % 2 == 0 else i)
    return i | (8 if math.copysign(1.0, value) < 0 else 0)


def _nibbles(q: torch.Tensor) -> list:
    return [[n for byte in row for n in (byte & 0xF, byte >> 4)] for row in q.tolist()]


def _block(*head: float) -> list:
    return list(head) + [0.0] * (32 - len(head))


# --- hand-worked vectors ----------------------------------------------------------------------

def test_every_code_and_nibble_order_with_unit_scale():
    # amax 6: floor(log2 6) - 2 = 0 -> X = 1, code 127; ceil: 6 / 6 = 1 -> 2^0, code 127.
    row = [0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6] * 2
    for rounding in ("floor", "ceil"):
        q, scale = reference(torch.tensor([row]), rounding)
        assert scale.tolist() == [[127]]
        assert q.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2]


def test_ties_to_even_and_saturation():
    x = torch.tensor([_block(6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0),
                      _block(7.0, 6.5, -7.0)])
    q, scale = reference(x, "floor")
    assert scale.tolist() == [[127], [127]]  # amax 7: floor(log2 7) = 2 -> X = 1
    assert _nibbles(q)[0][:10] == [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xE]
    assert _nibbles(q)[1][:3] == [7, 7, 0xF]  # 7 and 6.5 saturate to 6
    # ceil: amax 7 -> 7 / 6 = 1.17 -> X = 2 (code 128): 7 / 2 = 3.5 ties to 4, 6.5 / 2 -> 3.
    q, scale = reference(x[1:], "ceil")
    assert scale.tolist() == [[128]] and _nibbles(q)[0][:3] == [6, 5, 0xE]


@pytest.mark.parametrize(
    "amax, floor_code, ceil_code",
    [
        (1.0, 125, 125),   # floor: 0 - 2; ceil: log2(1/6) = -2.58 -> -2
        (1.5, 125, 125),   # floor: 0 - 2; ceil: 0.25 exactly -> -2
        (3.0, 126, 126),   # 1 - 2; 0.5 -> -1
        (5.0, 127, 127),   # 2 - 2; 0.83 -> 0
        (8.0, 128, 128),   # 3 - 2; 1.33 -> 1
        (12.0, 128, 128),  # 3 - 2; 2 exactly -> 1
        (13.0, 128, 129),  # 3 - 2; 2.17 -> 2
        (0.75, 124, 124),  # -1 - 2; 0.125 -> -3
        (2.0**-124, 1, 1),  # floor -126; ceil(log2(2^-124 / 6)) = -126
        (2.0**-125, 0, 0),  # -127
        (2.0**-126, 0, 0),  # floor -128, clamped to -127; ceil -128.58 -> -128, clamped
        (2.0**-140, 0, 0),  # fp32 subnormal: clamped
        (float(np.finfo(np.float32).max), 252, 253),  # 127 - 2; 2^125.4 -> 126
    ],
)
def test_scale_exponent_floor_ceil_and_clamp(amax, floor_code, ceil_code):
    x = torch.tensor([_block(amax, -amax / 2)])
    for rounding, code in (("floor", floor_code), ("ceil", ceil_code)):
        q, scale = reference(x, rounding)
        assert scale.item() == code, rounding
        X = 2.0 ** (code - 127)
        assert _nibbles(q)[0][:2] == [e2m1_encode(amax / X), e2m1_encode(-amax / 2 / X)], rounding


def test_clamped_scale_keeps_small_blocks_representable():
    # 2^-126 with X = 2^-127 is 2 (code 4): the clamp loses range, not the value.
    q, scale = reference(torch.tensor([_block(2.0**-126, 2.0**-127, 2.0**-130)]), "floor")
    assert scale.item() == 0 and _nibbles(q)[0][:3] == [4, 2, 0]
    # ceil: 6 * 2^-127 (normal) / 6 = 2^-127 exactly -> e = -127, code 0; 6 -> code 7.
    q, scale = reference(torch.tensor([_block(6 * 2.0**-127)]), "ceil")
    assert scale.item() == 0 and _nibbles(q)[0][0] == 7


def test_zero_and_nonfinite_blocks():
    x = torch.tensor([_block(-0.0, -0.0) + _block(1.0, float("nan"), -2.0) + _block(float("inf"), 1.0)
                      + _block(float("-inf")) + _block(3.0, -1.0)])
    for rounding in ("floor", "ceil"):
        q, scale = reference(x, rounding)
        assert scale.tolist()[0][:4] == [0, 0xFF, 0xFF, 0xFF]
        codes = _nibbles(q)[0]
        assert codes[:128] == [0] * 128  # zero block (with -0.0) and NaN/Inf blocks: codes 0
        assert codes[128:130] == [7, 0xC] and scale.tolist()[0][4] == 126


def test_rejects_ragged_k():
    for cols in (16, 48, 0):
        with pytest.raises(InvalidArgumentError, match="multiple of 32") as info:
            SPEC.validate(torch.zeros(2, cols))
        assert info.value.argument == "x"


# --- an independent oracle and round-trip bounds ----------------------------------------------

def _oracle(x: torch.Tensor, rounding: str):
    values = x.float().numpy()
    rows, cols = values.shape
    codes, scales = [], []
    for r in range(rows):
        code_row, scale_row = [], []
        for b in range(cols // 32):
            block = [float(v) for v in values[r, b * 32:(b + 1) * 32]]
            if not all(math.isfinite(v) for v in block):
                scale_row.append(0xFF)
                code_row += [0] * 32
                continue
            amax = max(abs(v) for v in block)
            if amax == 0:
                scale_row.append(0)
                code_row += [0] * 32
                continue
            if rounding == "floor":
                e = math.frexp(amax)[1] - 1 - 2
            else:
                d = float(f32(amax) / f32(6.0))
                mantissa, exponent = math.frexp(d)
                e = exponent - 1 if mantissa == 0.5 else exponent
            e = min(max(e, -127), 127)
            scale_row.append(e + 127)
            code_row += [e2m1_encode(v / 2.0**e) for v in block]
        codes.append(code_row)
        scales.append(scale_row)
    return codes, scales


@settings(deadline=None, max_examples=60)
@given(
    rows=st.integers(0, 4),
    blocks=st.integers(1, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    magnitude=st.sampled_from([1e-40, 1e-3, 1.0, 300.0, 1e30]),
    rounding=st.sampled_from(["floor", "ceil"]),
    special=st.sampled_from([None, "nan", "inf", "zero"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_scalar_oracle(rows, blocks, dtype, magnitude, rounding, special, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 32, generator=generator) * magnitude
    x *= torch.logspace(-2, 0, blocks).repeat_interleave(32)
    x[:, ::5] = 0.0
    if rows and special == "nan":
        x[0, 3] = float("nan")
    elif rows and special == "inf":
        x[-1, -1] = -float("inf")
    elif rows and special == "zero":
        x[0, :32] = 0.0
    x = x.to(dtype)
    q, scale = reference(x, rounding)
    codes, scales = _oracle(x, rounding)
    assert scale.tolist() == scales
    assert _nibbles(q) == codes


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_round_trip_error_is_within_half_an_e2m1_step(rounding):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 512, generator=generator) * torch.logspace(-30, 30, 64).unsqueeze(1)
    q, scale = reference(x, rounding)
    table = torch.tensor([(-1) ** (c >> 3) * E2M1[c & 7] for c in range(16)], dtype=torch.float64)
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(64, 512).long()
    X = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    v = x.double() / X
    error = (table[codes] * X - x.double()).abs()
    a = v.abs()
    half = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).double()
    if rounding == "ceil":
        assert bool((a <= 6).all())  # ceil never saturates
    bound = torch.maximum(half, a - 6) * X  # floor: amax / X in [4, 8), above 6 saturates
    assert bool((error <= bound).all()), float((error / bound).max())


# --- the spec's other parts --------------------------------------------------------------------

@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v
                        for k, v in kwargs.items()})
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")
    SPEC.validate(**kwargs)
    SPEC.check_close(real, reference(**kwargs), kwargs)


def test_edge_cases_behave_as_documented():
    q, scale = reference(**SPEC.case("nonfinite_blocks").build())
    assert scale.diagonal().tolist() == [0xFF] * 3
    q, scale = reference(**SPEC.case("zero_blocks").build())
    assert scale[::2].count_nonzero() == 0 and q[::2].count_nonzero() == 0 and scale[1, 0] == 0
    q, _ = reference(**SPEC.case("saturating_floor").build())
    assert {row[0] for row in _nibbles(q)} == {7}
    _, scale = reference(**SPEC.case("tiny_fp32_floor").build())
    assert scale.max() <= 2


def test_check_close_is_bit_exact_and_names_the_first_mismatch():
    kwargs = SPEC.case("small_fp16_ceil").build()
    q, scale = reference(**kwargs)
    SPEC.check_close((q.clone(), scale.clone()), (q, scale), kwargs)
    bumped = q.clone()
    bumped[3, 5] ^= 1
    with pytest.raises(AssertionError, match=r"q: 1 of 560 .*first at \(3, 5\)"):
        SPEC.check_close((bumped, scale), (q, scale), kwargs)
    bumped = scale.clone()
    bumped[6, 4] += 1
    with pytest.raises(AssertionError, match=r"scale: 1 of 35 .*first at \(6, 4\)"):
        SPEC.check_close((q, bumped), (q, scale), kwargs)


def test_cases_cover_the_model_shapes_and_tags():
    names = {c.name for c in SPEC.cases}
    assert {"gpt_oss_120b_expert_w_rows2880_floor", "gpt_oss_120b_act_m1", "empty",
            "nonfinite_blocks", "zero_blocks", "saturating_floor"} <= names
    assert SPEC.cases_tagged("quick") and SPEC.cases_tagged("random") and SPEC.cases_tagged("edge")


def test_cost_counts_each_input_and_output_once():
    cost = SPEC.cost(SPEC.case("gpt_oss_120b_act_m128").build())
    assert cost.bytes == 128 * 2880 * 2 + 128 * 1440 + 128 * 90 and cost.flops > 0


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"x": torch.zeros(4, 64, dtype=torch.float64)}, "x", "dtype in"),
        ({"x": torch.zeros(4, 64, dtype=torch.uint8)}, "x", "dtype in"),
        ({"x": torch.zeros(64)}, "x", "2-d tensor"),
        ({"x": 1.0}, "x", "torch.Tensor"),
        ({"x": torch.zeros(4, 80)}, "x", "multiple of 32"),
        ({"rounding": "nearest"}, "rounding", "one of"),
        ({"rounding": None}, "rounding", "one of"),
        ({"scale_layout": "128x4"}, "scale_layout", "swizzled_128x4"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    kwargs = dict(x=torch.randn(4, 64), rounding="floor")
    kwargs.update(changes)
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**kwargs)
    assert info.value.argument == argument and info.value.op == "quantize_mxfp4"
    assert fragment in str(info.value), str(info.value)


def test_key_reflects_dispatch_properties():
    key = SPEC.validate(torch.randn(4, 64))
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.x_dtype, key.k, key.rounding) == (
        torch.device("cpu"), torch.float32, 64, "floor")
    # M changes per batch: the key holds its class only (M = 4 and 7: class 7; 9: class 15).
    assert key.m_class == 7
    assert key == SPEC.validate(torch.randn(7, 64))
    assert SPEC.validate(torch.randn(9, 64)) == key._replace(m_class=15)
    assert SPEC.validate(torch.randn(4, 64), "ceil") == key._replace(rounding="ceil")
    assert key != SPEC.validate(torch.randn(4, 64, dtype=torch.bfloat16))
    assert key != SPEC.validate(torch.randn(4, 96))
    assert spec_module.ROUNDINGS == ("floor", "ceil")
    assert SPEC.validate(torch.randn(4, 64), scale_layout="swizzled_128x4") == key._replace(
        scale_layout="swizzled_128x4")
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_the_layout_field():
    key = SPEC.validate(torch.randn(4, 64))
    assert key.x_layout == Layout(unit_stride=True, alignment=16)
    # x one element into a wider buffer: rows 65 fp32 (260 bytes) apart.
    shifted = SPEC.validate(torch.randn(4, 65)[:, 1:])
    assert shifted.x_layout == Layout(unit_stride=True, alignment=4)
    assert shifted._replace(x_layout=key.x_layout) == key
    # a column-major view: K is not the contiguous dim.
    strided = SPEC.validate(torch.randn(64, 4).T)
    assert not strided.x_layout.unit_stride
    assert strided._replace(x_layout=key.x_layout) == key


@pytest.mark.parametrize("name", ["small_swizzled_ragged", "gpt_oss_120b_act_m128_swizzled"])
def test_swizzled_scales_are_the_linear_ones_swizzled_with_zero_padding(name):
    kwargs = SPEC.case(name).build(seed=6)
    q, scale = reference(**kwargs)
    q_linear, scale_linear = reference(**dict(kwargs, scale_layout="linear"))
    assert torch.equal(q, q_linear)
    assert torch.equal(scale, swizzled_by_loop(scale_linear))
    assert SPEC.cost(kwargs).bytes == SPEC.cost(dict(kwargs, scale_layout="linear")).bytes + scale.numel() - \
        scale_linear.numel()
