"""The quantize_nvfp4 spec: its reference against e2m1 and e4m3 code tables built from the format
definitions, hand-worked vectors, an independent scalar oracle, round-trip bounds; validation,
fake, cases and cost."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4_layouts import swizzled_by_loop
from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import quantize_nvfp4 as spec_module
from kernelmux.specs.quantize_nvfp4 import SPEC

reference = SPEC.reference
f32 = np.float32

# --- the formats, from their definitions (not from torch's casts) -----------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0..7 (1 sign, 2 exponent, 1 mantissa)


def _e2m1_decode(code: int) -> float:
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    value = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -value if sign else value


def _e4m3_decode(code: int) -> float:
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 0:
        return mantissa / 8 * 2.0**-6
    return (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = [_e4m3_decode(c) for c in range(0x7F)]  # 0x7F is NaN; ascending in the code


def _rne(table: list, magnitude: float) -> int:
    """Index of the nearest table value, a tie to the even index, saturating at the top."""
    magnitude = min(magnitude, table[-1])
    i = bisect.bisect_left(table, magnitude)
    if table[i] == magnitude:
        return i
    low, high = magnitude - table[i - 1], table[i] - magnitude
    if low != high:
        return i - 1 if low < high else i
    return i - 1 if (i - 1) % 2 == 0 else i


def e2m1_encode(value: float) -> int:
    return _rne(E2M1, abs(value)) | (8 if math.copysign(1.0, value) < 0 else 0)


def test_tables_match_the_definitions():
    assert [_e2m1_decode(c) for c in range(8)] == E2M1
    assert [_e2m1_decode(c) for c in range(8, 16)] == [-v for v in E2M1]
    assert E4M3[-1] == 448.0 and E4M3[1] == 2.0**-9 and E4M3[0x38] == 1.0
    assert list(spec_module.E2M1_VALUES) == E2M1


def _nibbles(q: torch.Tensor) -> list:
    """Unpack [M, K/2] bytes to per-element codes, low nibble first."""
    out = []
    for row in q.tolist():
        out.append([n for byte in row for n in (byte & 0xF, byte >> 4)])
    return out


# --- hand-worked vectors ----------------------------------------------------------------------

def test_every_code_with_unit_ratio_and_nibble_order():
    # amax(x) = 6: gs = 2688 / 6 = 448; the block's sf = e4m3(448 * 6 / 6) = 448; r = 1.
    x = torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]])
    q, sf, gs = reference(x)
    assert gs.shape == () and gs.item() == 448.0 and sf.float().tolist() == [[448.0]]
    assert q.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]


def test_ties_go_to_the_even_code_and_values_saturate():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                       -0.25, -0.75, 0.1, 5.5, 4.9, 5.1, -0.1, 6.0]])
    q, _, gs = reference(x)
    assert gs.item() == 448.0
    assert _nibbles(q) == [[
        0,  # 0.25: tie 0 / 0.5 -> 0 (code 0)
        2,  # 0.75: tie 0.5 / 1.0 -> 1.0 (code 2)
        2,  # 1.25: tie 1.0 / 1.5 -> 1.0 (code 2)
        4,  # 1.75: tie 1.5 / 2.0 -> 2.0 (code 4)
        4,  # 2.5: tie 2 / 3 -> 2 (code 4)
        6,  # 3.5: tie 3 / 4 -> 4 (code 6)
        6,  # 5: tie 4 / 6 -> 4 (code 6)
        7, 8,  # -0.25 rounds to -0 (code 8)
        0xA, 0, 7, 6, 7,
        8,  # -0.1 -> -0
        7]]
    # 7 with r = 1 saturates to 6: a passed-in gs of 448 and a block amax of 7 clamps sf at 448.
    q, sf, _ = reference(torch.tensor([[7.0, -7.0, 100.0] + [0.0] * 13]), torch.tensor(448.0))
    assert sf.float().item() == 448.0 and _nibbles(q)[0][:3] == [7, 0xF, 7]


def test_block_scale_rounds_to_nearest_even_e4m3():
    # Passed gs = 448, block amax 1: 448 / 6 = 74.67 -> e4m3 72 (step 8 in [64, 128));
    # r = fl(448 / 72) = 6.2222: 1 -> 6 (code 7), 0.5 -> 3.11 -> 3 (code 5).
    x = torch.tensor([[1.0, 0.5] + [0.0] * 14 + [1.0, 0.5] + [0.0] * 14])
    q, sf, gs = reference(x[:, :16], torch.tensor([448.0]))
    assert gs.shape == () and sf.float().tolist() == [[72.0]] and _nibbles(q)[0][:2] == [7, 5]
    # gs = 456: 456 * 1 / 6 = 76 exactly, a tie between 72 (mantissa 001) and 80 (010) -> 80.
    q, sf, _ = reference(x[:, :16], torch.tensor(456.0))
    assert sf.float().tolist() == [[80.0]]
    r = f32(456.0) / f32(80.0)
    assert _nibbles(q)[0][:2] == [e2m1_encode(float(f32(1.0) * r)), e2m1_encode(float(f32(0.5) * r))]


def test_dynamic_global_scale_and_two_blocks():
    # amax(x) = 3: gs = 896. Block 0 (amax 3): sf = 448, r = 2 (0.75 -> 1.5, code 3). Block 1 (amax 1): 896 / 6 =
    # 149.33 -> e4m3 144 (step 16 in [128, 256)), r = fl(896 / 144) = 6.22: 1 -> 6, -0.25 -> -1.5.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16], x[0, 17] = 3.0, 0.75, 1.0, -0.25
    q, sf, gs = reference(x.to(torch.bfloat16))
    assert gs.item() == 896.0 and sf.float().tolist() == [[448.0, 144.0]]
    codes = _nibbles(q)[0]
    assert codes[:2] == [7, 3] and codes[16:18] == [7, 0xB] and set(codes[2:16] + codes[18:]) == {0}


def test_zero_and_vanishing_blocks_get_codes_zero():
    # amax(x) = 0 -> gs = 1, sf 0, codes 0 even for -0.0.
    q, sf, gs = reference(torch.full((2, 32), -0.0))
    assert gs.item() == 1.0 and sf.float().abs().sum() == 0 and q.count_nonzero() == 0
    q, sf, gs = reference(torch.zeros(0, 64))
    assert gs.item() == 1.0 and q.shape == (0, 32) and sf.shape == (0, 4)
    # An outlier of 1e4: gs = 0.2688; a block of amax 1e-3 gets sf = e4m3(4.5e-5) = 0: codes 0
    # (its negatives too); a block of amax 0.05 gets a subnormal sf.
    x = torch.zeros(1, 48)
    x[0, 0], x[0, 16], x[0, 17], x[0, 32] = 1e4, 1e-3, -1e-3, 0.05
    q, sf, gs = reference(x)
    assert gs.item() == f32(2688.0) / f32(1e4)
    expected_sf = E4M3[_rne(E4M3, float(f32(f32(gs.item()) * f32(0.05)) / f32(6.0)))]
    assert sf.float().tolist() == [[448.0, 0.0, expected_sf]] and 0 < expected_sf < 2.0**-6
    codes = _nibbles(q)[0]
    assert codes[16:32] == [0] * 16 and codes[32] == 7


def test_rejects_ragged_k():
    with pytest.raises(InvalidArgumentError, match="multiple of 16") as info:
        SPEC.validate(torch.zeros(2, 24))
    assert info.value.argument == "x"


# --- an independent oracle and round-trip bounds on drawn data --------------------------------

def _oracle(x: torch.Tensor, global_scale):
    """quantize_nvfp4 one block and one element at a time: numpy fp32 scalars, table encodings."""
    values = x.float().numpy()
    rows, cols = values.shape
    amax = f32(np.abs(values).max(initial=0.0))
    if global_scale is not None:
        gs = f32(global_scale)
    else:
        gs = f32(2688.0) / amax if amax > 0 else f32(1.0)
    scales, codes = [], []
    for r in range(rows):
        scale_row, code_row = [], []
        for b in range(cols // 16):
            block = values[r, b * 16:(b + 1) * 16]
            target = min(float(f32(gs * f32(np.abs(block).max())) / f32(6.0)), 448.0)
            sf = E4M3[_rne(E4M3, target)]
            scale_row.append(sf)
            if sf == 0:
                code_row += [0] * 16
            else:
                ratio = gs / f32(sf)
                code_row += [e2m1_encode(float(f32(v) * ratio)) for v in block]
        scales.append(scale_row)
        codes.append(code_row)
    return codes, scales, float(gs)


@settings(deadline=None, max_examples=60)
@given(
    rows=st.integers(0, 4),
    blocks=st.integers(1, 6),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    static=st.sampled_from([None, 1.0, 300.0, 5000.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_scalar_oracle(rows, blocks, dtype, magnitude, static, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 16, generator=generator) * magnitude
    x *= torch.logspace(-3, 0, blocks).repeat_interleave(16)  # blocks of different magnitudes
    x[:, ::7] = 0.0
    x = x.to(dtype)
    gs_in = None if static is None else torch.tensor(static)
    q, sf, gs = reference(x, gs_in)
    codes, scales, gs_expected = _oracle(x, static)
    assert gs.item() == gs_expected
    assert sf.float().tolist() == scales
    assert _nibbles(q) == codes


def _half_step(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_is_within_half_an_e2m1_step(dtype):
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 512, generator=generator) * torch.logspace(-3, 3, 64).unsqueeze(1)).to(dtype)
    q, sf, gs = reference(x)
    table = torch.tensor([_e2m1_decode(c) for c in range(16)], dtype=torch.float64)
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(64, 512).long()
    scale = (sf.double() / gs.double()).repeat_interleave(16, dim=1)
    error = (table[codes] * scale - x.double()).abs()
    # |e2m1(v) - v| <= half a step at |v| (v = x gs / sf), times sf / gs. v exceeds 6 only when
    # sf was rounded down to e4m3 (a normal sf by < 1/15, a subnormal one by more): it then
    # saturates, an error of |v| - 6. Blocks with sf = 0 lose x entirely.
    v = x.double() / scale
    step = torch.maximum(_half_step(v), v.abs() - 6)
    bound = step * scale * (1 + 2.0**-20)
    normal = sf.float().repeat_interleave(16, dim=1) >= 2.0**-6
    assert bool((v.abs()[normal] < 6 * 16 / 15 * (1 + 2.0**-20)).all())
    bound = torch.where(scale == 0, x.double().abs(), bound)
    assert bool((error <= bound).all()), float((error / bound).max())


# --- the spec's other parts --------------------------------------------------------------------

def _to_meta(kwargs):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**_to_meta(kwargs))
    assert len(fake) == len(real) == 3
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")
    SPEC.validate(**kwargs)
    SPEC.check_close(real, reference(**kwargs), kwargs)


def test_edge_cases_behave_as_documented():
    q, sf, gs = reference(**SPEC.case("all_zero").build())
    assert gs.item() == 1.0 and q.count_nonzero() == 0
    q, sf, _ = reference(**SPEC.case("zero_blocks").build())
    assert q[::2].count_nonzero() == 0 and q[1, :16].count_nonzero() == 0
    assert sf.float()[1, :2].tolist() == [0.0, 0.0]
    for name in ("extremes_bf16", "extremes_fp16", "tiny_fp32", "saturating_static"):
        q, sf, gs = reference(**SPEC.case(name).build())
        assert torch.isfinite(gs) and gs > 0 and torch.isfinite(sf.float()).all(), name
    q, _, _ = reference(**SPEC.case("extremes_bf16").build())
    assert [row[0] for row in _nibbles(q)][:2] == [7, 0xF]


def test_check_close_is_bit_exact_and_names_the_first_mismatch():
    kwargs = SPEC.case("small_fp16").build()
    q, sf, gs = reference(**kwargs)
    SPEC.check_close((q.clone(), sf.clone(), gs.clone()), (q, sf, gs), kwargs)
    bumped = q.clone()
    bumped[2, 17] ^= 0x10
    with pytest.raises(AssertionError, match=r"q: 1 of 560 .*first at \(2, 17\)"):
        SPEC.check_close((bumped, sf, gs), (q, sf, gs), kwargs)
    sf_bumped = sf.view(torch.uint8).clone()
    sf_bumped[1, 3] += 1
    with pytest.raises(AssertionError, match=r"block_scale: 1 of 70 .*first at \(1, 3\)"):
        SPEC.check_close((q, sf_bumped.view(sf.dtype), gs), (q, sf, gs), kwargs)
    with pytest.raises(AssertionError, match="global_scale"):
        SPEC.check_close((q, sf, torch.nextafter(gs, torch.tensor(0.0))), (q, sf, gs), kwargs)
    with pytest.raises(AssertionError, match="float32"):
        SPEC.check_close((q, sf.float(), gs), (q, sf, gs), kwargs)


def test_cases_cover_the_model_shapes_and_tags():
    names = {c.name for c in SPEC.cases}
    assert {"deepseek_v3_m1", "deepseek_v3_m128", "deepseek_v3_m1024", "llama3_8b_m1024",
            "empty", "zero_blocks", "saturating_static"} <= names
    assert SPEC.cases_tagged("quick") and SPEC.cases_tagged("random") and SPEC.cases_tagged("edge")


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("deepseek_v3_m128").build()
    cost = SPEC.cost(kwargs)
    assert cost.bytes == 128 * 7168 * 2 + 128 * 3584 + 128 * 448 + 4 and cost.flops > 0


def _good(**changes):
    kwargs = dict(x=torch.randn(4, 64), global_scale=None)
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"x": torch.zeros(4, 64, dtype=torch.float64)}, "x", "dtype in"),
        ({"x": torch.zeros(4, 64, dtype=torch.float8_e4m3fn)}, "x", "dtype in"),
        ({"x": torch.zeros(2, 4, 64)}, "x", "2-d tensor"),
        ({"x": [[0.0] * 16]}, "x", "torch.Tensor"),
        ({"x": torch.zeros(4, 0)}, "x", "multiple of 16"),
        ({"x": torch.zeros(4, 8)}, "x", "multiple of 16"),
        ({"x": torch.zeros(4, 40)}, "x", "multiple of 16"),
        ({"global_scale": 448.0}, "global_scale", "torch.Tensor"),
        ({"global_scale": torch.tensor(448.0, dtype=torch.bfloat16)}, "global_scale", "float32"),
        ({"global_scale": torch.ones(2)}, "global_scale", "one element"),
        ({"global_scale": torch.ones(1, 1)}, "global_scale", "one element"),
        ({"global_scale": torch.ones(1, device="meta")}, "global_scale", "x's device"),
        ({"scale_layout": "swizzled"}, "scale_layout", "swizzled_128x4"),
        ({"scale_layout": None}, "scale_layout", "linear"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument and info.value.op == "quantize_nvfp4"
    assert fragment in str(info.value), str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.x_dtype, key.k, key.global_scale_layout) == (
        torch.device("cpu"), torch.float32, 64, None)
    # M changes per batch: the key holds its class only (M = 4 and 7: class 7; 9: class 15).
    assert key.m_class == 7
    assert key == SPEC.validate(**_good(x=torch.randn(7, 64)))
    assert SPEC.validate(**_good(x=torch.randn(9, 64))) == key._replace(m_class=15)
    assert key != SPEC.validate(**_good(x=torch.randn(4, 64, dtype=torch.bfloat16)))
    static = SPEC.validate(**_good(global_scale=torch.tensor([1.0])))
    assert static.global_scale_layout is not None
    assert static._replace(global_scale_layout=None) == key
    assert SPEC.validate(**_good(x=torch.randn(4, 128))) == key._replace(k=128)
    assert key.scale_layout == "linear"
    assert SPEC.validate(**_good(scale_layout="swizzled_128x4")) == key._replace(scale_layout="swizzled_128x4")
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_the_layout_field():
    key = SPEC.validate(**_good())
    assert key.x_layout == Layout(unit_stride=True, alignment=16)
    # x one element into a wider buffer: rows 65 fp32 (260 bytes) apart.
    shifted = SPEC.validate(**_good(x=torch.randn(4, 65)[:, 1:]))
    assert shifted.x_layout == Layout(unit_stride=True, alignment=4)
    assert shifted._replace(x_layout=key.x_layout) == key
    # a column-major view: K is not the contiguous dim.
    strided = SPEC.validate(**_good(x=torch.randn(64, 4).T))
    assert not strided.x_layout.unit_stride
    assert strided._replace(x_layout=key.x_layout) == key


# --- the 128x4 swizzled scale layout ---------------------------------------------------------


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 2), (130, 5), (256, 8), (33, 12), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_swizzle_128x4_matches_an_independent_construction(rows, cols, dtype):
    scale = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    swizzled = spec_module.swizzle_128x4(scale.view(dtype))
    assert swizzled.dtype == dtype and swizzled.is_contiguous()
    assert tuple(swizzled.shape) == spec_module.scale_shape(rows, cols, "swizzled_128x4")
    assert torch.equal(swizzled.view(torch.uint8), swizzled_by_loop(scale))


@pytest.mark.parametrize("name", ["small_swizzled_ragged", "one_block_swizzled", "deepseek_v3_m128_swizzled"])
def test_swizzled_scales_are_the_linear_ones_swizzled_with_zero_padding(name):
    kwargs = SPEC.case(name).build(seed=5)
    q, sf, gs = reference(**kwargs)
    q_linear, sf_linear, gs_linear = reference(**dict(kwargs, scale_layout="linear"))
    assert torch.equal(q, q_linear) and torch.equal(gs, gs_linear)
    assert torch.equal(sf.view(torch.uint8), swizzled_by_loop(sf_linear))
    assert sf.view(torch.uint8).count_nonzero() <= sf_linear.view(torch.uint8).count_nonzero()


def test_cost_counts_the_swizzled_padding():
    kwargs = SPEC.case("small_swizzled_ragged").build()  # 130 x 80 fp32: scales 130 x 5 padded to 256 x 8
    assert SPEC.cost(kwargs).bytes == 130 * 80 * 4 + 130 * 40 + 256 * 8 + 4
