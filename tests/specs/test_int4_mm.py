"""The int4_mm spec: its activation quantization against a scalar fp32 re-derivation of KleidiAI's
(np.float32 step by step), its output against a float64 oracle, hand-worked rounding cases, the
int4 packing, validation, fake, closeness check, cases and cost."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs import int4_mm as spec_module
from kernelmux.specs._key import Layout
from kernelmux.specs.int4_mm import SPEC

reference = SPEC.reference
# Half an ulp of the output format relative to the value (at most: at a power of two), for 8, 11
# and 24 significant bits: the reference rounds its fp32 result once.
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _scalar_row(row: np.ndarray) -> tuple[list[int], int, np.float32]:
    """One row's (q, zero point, recip), written as the C of kai_run_lhs_quant_pack_qai8dxp_f32 reads:
    np.float32 scalars for every fp32 step, Python's math for the integer roundings."""
    f32 = np.float32
    rmin = min(f32(0.0), f32(row.min()))
    rmax = max(f32(0.0), f32(row.max()))
    scale = f32(1.0) if rmin == rmax else f32(255.0) / (rmax - rmin)
    recip = f32(1.0) / scale if scale else f32(0.0)
    low, high = rmin * scale, rmax * scale
    zero_point = f32(-128.0) - low if (f32(-128.0) + low) + (f32(127.0) + high) > 0 else f32(127.0) - high
    zero_point = int(np.rint(min(max(zero_point, f32(-128.0)), f32(127.0))))  # rintf: half to even
    q = []
    for value in row:
        product = float(f32(value) * scale)  # exact in a Python float
        rounded = int(math.copysign(math.floor(abs(product) + 0.5), product))  # roundf: half away
        q.append(min(max(rounded + zero_point, -128), 127))
    return q, zero_point, recip


def _oracle(kwargs):
    """float64 ``(out, magnitude)`` from integer products: W4A8 from ``_scalar_row``'s quantization,
    W4A16 from ``a`` itself; weights as integer values times their scale."""
    a, b, b_scale, group = kwargs["a"], kwargs["b"], kwargs["b_scale"], kwargs["group_size"]
    channels, cols = b.shape[0], 2 * b.shape[1]
    low, high = (b & 0x0F).long() - 8, (b >> 4).long() - 8
    values = torch.stack((low, high), dim=-1).reshape(channels, cols).double()
    weights = values * b_scale.double().repeat_interleave(group, dim=1)
    if kwargs["act_quant"] == "none":
        acts = a.double()
    else:
        rows = [_scalar_row(r) for r in a.float().numpy()]
        shifted = torch.tensor([[q - zp for q in qs] for qs, zp, _ in rows], dtype=torch.float64)
        recips = torch.tensor([float(recip) for _, _, recip in rows], dtype=torch.float64)
        acts = (shifted.reshape(a.shape[0], cols) * recips.reshape(-1, 1))
    out, mag = acts @ weights.T, acts.abs() @ weights.abs().T
    if kwargs["bias"] is not None:
        out, mag = out + kwargs["bias"].double(), mag + kwargs["bias"].double().abs()
    return out, mag


def _assert_matches_oracle(kwargs):
    out = reference(**kwargs)
    assert out.dtype == kwargs["a"].dtype
    assert out.shape == (kwargs["a"].shape[0], kwargs["b"].shape[0])
    exact, mag = _oracle(kwargs)
    # One rounding to the output dtype plus the reference's fp32 steps (a group's sum times its
    # scale, the running sum, the row's recip): 2^-16 of sum |A||W| is far above those and far below
    # a wrong code, scale or quantization step. 2^-25: half of fp16's subnormal step.
    bound = HALF_ULP[out.dtype] * exact.abs() * (1 + 2.0**-8) + 2.0**-16 * mag + 2.0**-25
    error = (out.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error / bound {float((error / bound).max()):.3g}"


def _assert_quantization_matches_scalar(a):
    rows = spec_module.quantize_int8_rows(a)
    for i, row in enumerate(a.float().numpy()):
        q, zero_point, recip = _scalar_row(row)
        assert rows.q[i].tolist() == q, i
        assert rows.zero_point[i].item() == zero_point, i
        assert rows.recip[i].item() == float(recip), i


@pytest.mark.parametrize(
    "case", [c for c in SPEC.cases if c.tags & {"random", "edge"} or c.name == "llama3_8b_o_proj_m1_g32"
             or c.name == "llama3_8b_down_proj_m1_g32"], ids=lambda c: c.name)
def test_reference_matches_float64_oracle_on_cases(case):
    kwargs = case.build(seed=5)
    SPEC.validate(**kwargs)
    if kwargs["act_quant"] == "int8_dynamic":
        _assert_quantization_matches_scalar(kwargs["a"])
    _assert_matches_oracle(kwargs)


@st.composite
def _shapes(draw):
    cols = 2 * draw(st.integers(1, 96))
    group = draw(st.sampled_from(sorted(d for d in range(1, cols + 1) if cols % d == 0)))
    return dict(rows=draw(st.integers(0, 9)), channels=draw(st.integers(1, 40)), cols=cols, group_size=group)


@given(
    shape=_shapes(),
    act_dtype=st.sampled_from(spec_module.ACTIVATION_DTYPES),
    scale_dtype=st.sampled_from(spec_module.SCALE_DTYPES),
    with_bias=st.booleans(),
    act_quant=st.sampled_from(spec_module.ACT_QUANTS),
    kind=st.sampled_from(["normal", "special"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_float64_oracle_on_drawn_shapes(shape, act_dtype, scale_dtype, with_bias, act_quant,
                                                          kind, seed):
    if kind == "special" and shape["rows"] < 5:
        kind = "normal"  # the special rows need five
    make = spec_module._maker(shape["rows"], shape["channels"], shape["cols"], shape["group_size"],
                              act_dtype=act_dtype, scale_dtype=scale_dtype, with_bias=with_bias,
                              act_quant=act_quant, kind=kind)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    SPEC.validate(**kwargs)
    if act_quant == "int8_dynamic":
        _assert_quantization_matches_scalar(kwargs["a"])
    _assert_matches_oracle(kwargs)
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    assert (fake.shape, fake.dtype) == (reference(**kwargs).shape, act_dtype)


# ---------------------------------------------------------------------------------------------
# Hand-worked quantization: each rounding rule of kai_run_lhs_quant_pack_qai8dxp_f32

def test_hand_worked_row_quantization():
    # [0, 1, -1, 2]: rmin -1, rmax 2, scale 255 / 3 = 85, recip 1/85. (-128 - 85) + (127 + 170) = 84 > 0:
    # zp = -128 + 85 = -43; q = round(x * 85) - 43.
    rows = spec_module.quantize_int8_rows(torch.tensor([[0.0, 1.0, -1.0, 2.0]]))
    assert rows.q.tolist() == [[-43, 42, -128, 127]]
    assert rows.zero_point.item() == -43 and rows.scale.item() == 85.0
    assert rows.recip.item() == np.float32(1.0) / np.float32(85.0)
    # Weights all 1 (code 9), per-channel scale 0.5: (0 + 85 - 85 + 170) * 0.5 / 85 = 1.
    b = spec_module.pack_int4(torch.ones(2, 4, dtype=torch.int8))
    assert b.tolist() == [[0x99, 0x99]] * 2
    out = reference(torch.tensor([[0.0, 1.0, -1.0, 2.0]]), b, torch.full((2, 1), 0.5), 4)
    assert out.tolist() == [[1.0, 1.0]]


def test_products_round_half_away_from_zero():
    # [0.5, 2.5, 255]: rmin 0, rmax 255, scale 1, zp -128 (all positive). roundf(0.5) = 1 and
    # roundf(2.5) = 3, where torch.round (half to even) would give 0 and 2.
    rows = spec_module.quantize_int8_rows(torch.tensor([[0.5, 2.5, 255.0]]))
    assert (rows.scale.item(), rows.zero_point.item()) == (1.0, -128)
    assert rows.q.tolist() == [[-127, -125, 127]]
    # All negative: rmax 0, zp 127; roundf(-2.5) = -3.
    rows = spec_module.quantize_int8_rows(torch.tensor([[-2.5, -255.0]]))
    assert (rows.zero_point.item(), rows.q.tolist()) == (127, [[124, -128]])


def test_zero_point_rounds_half_to_even():
    # rmin -1.5, rmax 253.5: scale 1, zp = -128 + 1.5 = -126.5, rintf -> -126 (half away: -127).
    rows = spec_module.quantize_int8_rows(torch.tensor([[-1.5, 253.5]]))
    assert rows.zero_point.item() == -126
    assert rows.q.tolist() == [[-128, 127]]  # round(-1.5) = -2: -128; round(253.5) = 254: clamped


def test_all_zero_and_constant_rows():
    rows = spec_module.quantize_int8_rows(torch.tensor([[0.0, -0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]]))
    # All zero: scale 1, recip 1, zp: (-128 + 0) + (127 + 0) = -1 <= 0 -> 127 - 0 = 127.
    assert rows.scale[0].item() == 1.0 and rows.zero_point[0].item() == 127 and rows.q[0].tolist() == [127] * 4
    # Constant 3: rmin 0 (the range holds 0), rmax 3, scale 85, zp -128, q = 255 - 128.
    assert rows.zero_point[1].item() == -128 and rows.q[1].tolist() == [127] * 4
    out = reference(torch.zeros(2, 4), spec_module.pack_int4(torch.full((3, 4), 7, dtype=torch.int8)),
                    torch.ones(3, 1), 4, torch.tensor([1.0, -2.0, 0.5]))
    assert out.tolist() == [[1.0, -2.0, 0.5]] * 2  # an all-zero row gives exactly the bias


def test_w4a16_uses_activations_as_they_are():
    a = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float32)
    b = spec_module.pack_int4(torch.tensor([[1, -2, 3, -8]], dtype=torch.int8))
    out = reference(a, b, torch.tensor([[0.5, 0.25]]), 2, act_quant="none")
    expected = (0.1 * 1 + 0.2 * -2) * 0.5 + (0.3 * 3 + 0.4 * -8) * 0.25
    assert out.item() == pytest.approx(expected, rel=1e-6)
    assert out.item() != reference(a, b, torch.tensor([[0.5, 0.25]]), 2).item()  # W4A8 differs


def test_groups_accumulate_in_fp32_in_order():
    # torch's fallback: per group float(iacc) * scale, added to an fp32 running sum in K order. A row
    # [255, 0] * 4 has scale 1, zp -128, q - zp = [255, 0] * 4; weights [1, 0] per group of 2 make
    # each group's sum 255, times the scales 2^25/255, 1/255, 1/255, 1/255: 2^25, then three 1s,
    # each lost in fp32 (2^25 + 1 rounds to 2^25); summed exactly and rounded once: 2^25 + 4.
    f32 = np.float32
    scales = [f32(2.0**25 / 255)] + [f32(1.0 / 255)] * 3
    running = f32(0.0)
    for scale in scales:
        running = f32(running + f32(255.0) * scale)
    assert float(running) == 2.0**25
    a = torch.tensor([[255.0, 0.0] * 4])
    b = spec_module.pack_int4(torch.tensor([[1, 0] * 4], dtype=torch.int8))
    out = reference(a, b, torch.tensor([[float(s) for s in scales]]), 2)
    assert out.item() == float(running) != float(f32(sum(255.0 * float(s) for s in scales)))


# ---------------------------------------------------------------------------------------------
# Packing

def test_pack_unpack_round_trip():
    generator = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (7, 12), dtype=torch.uint8, generator=generator)
    assert torch.equal(spec_module.pack_int4(spec_module.unpack_int4(packed)), packed)
    values = torch.randint(-8, 8, (5, 16), dtype=torch.int8, generator=generator)
    assert torch.equal(spec_module.unpack_int4(spec_module.pack_int4(values)), values)
    # vendors.md's layout: codes w = value + 8, b = w[:, 1::2] << 4 | w[:, ::2].
    codes = (values.int() + 8).to(torch.uint8)
    assert torch.equal(spec_module.pack_int4(values), codes[:, 1::2] << 4 | codes[:, ::2])
    # Element 0 in the low nibble: values [-8, 7] are codes [0, 15], byte 0xF0.
    assert spec_module.pack_int4(torch.tensor([[-8, 7]], dtype=torch.int8)).item() == 0xF0


def test_quantize_int4_weight():
    w = torch.tensor([[-8.0, 4.0, 0.0, 8.0], [0.0, 0.0, 1.0, -1.0]])
    b, scale = spec_module.quantize_int4_weight(w, 2, torch.float32)
    # Groups [-8, 4] (amax 8: scale 1), [0, 8] (scale 1, 8 clamps to 7), [0, 0] (scale 0), [1, -1].
    assert scale.tolist() == [[1.0, 1.0], [0.0, 0.125]]
    assert spec_module.unpack_int4(b).tolist() == [[-8, 4, 0, 7], [0, 0, 7, -8]]
    _, bf16 = spec_module.quantize_int4_weight(torch.randn(4, 64), 32)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (4, 2)


# ---------------------------------------------------------------------------------------------
# Fake, closeness, cases, cost

@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fake = SPEC.fake(**meta)
    SPEC.validate(**kwargs)
    if "model" in case.tags and "quick" not in case.tags:
        # The big cases' reference runs in the conformance suite; here shape arithmetic suffices.
        expected = (kwargs["a"].shape[0], kwargs["b"].shape[0])
        assert (tuple(fake.shape), fake.dtype) == (expected, kwargs["a"].dtype)
        return
    real = reference(**kwargs)
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")
    SPEC.check_close(real, reference(**kwargs), kwargs)


def _swap_nibbles(b):
    return (b >> 4) | (b << 4)


@pytest.mark.parametrize("name", ["llama3_8b_o_proj_m1_g32", "small_channelwise_bf16", "small_g64_bf16"])
def test_check_close_rejects_layout_and_quantization_bugs(name):
    kwargs = SPEC.case(name).build(seed=2)
    expected = reference(**kwargs)
    SPEC.check_close(expected.clone(), expected, kwargs)
    wrong = {
        "nibbles swapped": dict(kwargs, b=_swap_nibbles(kwargs["b"])),
        "the neighbouring channel's scales": dict(kwargs, b_scale=torch.roll(kwargs["b_scale"], 1, dims=0)),
        "the last group's scale doubled": dict(kwargs, b_scale=torch.cat(
            [kwargs["b_scale"][:, :-1], kwargs["b_scale"][:, -1:] * 2], dim=1)),
        "unquantized activations (W4A16)": dict(kwargs, act_quant="none"),
    }
    if kwargs["group_size"] < kwargs["a"].shape[1]:
        wrong["the neighbouring group's scales"] = dict(kwargs, b_scale=torch.roll(kwargs["b_scale"], 1, dims=1))
    for what, bad in wrong.items():
        with pytest.raises(AssertionError, match=r"int4_mm: \d+ of \d+ elements outside"):
            SPEC.check_close(reference(**bad), expected, kwargs)
            pytest.fail(f"{what} was accepted")
    with pytest.raises(AssertionError, match="float16"):
        SPEC.check_close(expected.to(torch.float16), expected, kwargs)


def test_check_close_allows_the_zero_point_split_and_another_group_order():
    # How W4A8 kernels sum: q * w per group (not (q - zp) * w), scaled and accumulated in fp32
    # backwards, then zp times the weights' fp32 row sums subtracted: within the tolerance, on
    # the boundary rows too (an all-positive row: zp -128; an outlier row: q - zp mostly 0).
    for name in ("small_g32", "special_rows_g32", "special_rows_channelwise_bias", "llama3_8b_kv_proj_m32_g128"):
        kwargs = SPEC.case(name).build(seed=4)
        a, group = kwargs["a"], kwargs["group_size"]
        rows = spec_module.quantize_int8_rows(a)
        values = spec_module.unpack_int4(kwargs["b"]).double()
        scales = kwargs["b_scale"].float()
        acc = torch.zeros(a.shape[0], values.shape[0])
        row_sums = torch.zeros(values.shape[0])
        for g in reversed(range(a.shape[1] // group)):
            span = slice(g * group, (g + 1) * group)
            acc = acc + (rows.q.double()[:, span] @ values[:, span].T).float() * scales[:, g]
            row_sums = row_sums + values[:, span].sum(dim=1).float() * scales[:, g]
        out = (acc - rows.zero_point.float() * row_sums) * rows.recip
        if kwargs["bias"] is not None:
            out = out + kwargs["bias"].float()
        SPEC.check_close(out.to(a.dtype), reference(**kwargs), kwargs)


def test_cases_cover_the_issue_shapes():
    names = {c.name for c in SPEC.cases}
    assert {f"llama3_8b_o_proj_m{m}_{g}" for m in (1, 32, 128) for g in ("g32", "channelwise")} <= names
    assert {"empty_g32", "one_channel_g32", "k_equals_group", "one_token_g32"} <= names
    keys = [SPEC.validate(**c.build()) for c in SPEC.cases if c.tags & {"random", "edge"}]
    assert {k.act_quant for k in keys} == set(spec_module.ACT_QUANTS)
    assert {k.a_dtype for k in keys} == set(spec_module.ACTIVATION_DTYPES)
    assert {k.scale_dtype for k in keys} == set(spec_module.SCALE_DTYPES)
    assert any(k.group_size == k.k for k in keys) and any(k.group_size < k.k for k in keys)
    assert {c.name for c in SPEC.cases_tagged("quick") if "model" in c.tags} == {
        "llama3_8b_o_proj_m1_g32", "llama3_8b_o_proj_m1_channelwise"}


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("small_channelwise_bias").build()  # M 5, N 40, K 64, fp32, fp32 scales [40, 1]
    cost = SPEC.cost(kwargs)
    assert cost.flops == 2 * 5 * 40 * 64
    assert cost.bytes == 5 * 64 * 4 + 40 * 32 + 40 * 4 + 40 * 4 + 5 * 40 * 4
    assert cost.matmul == "fp8"  # 8-bit integer dot products
    assert SPEC.cost(SPEC.case("small_w4a16_g32").build()).matmul == "bf16"
    assert SPEC.cost(SPEC.case("small_w4a16_channelwise_fp32_bias").build()).matmul == "fp32"


# ---------------------------------------------------------------------------------------------
# Validation and the key

def _good(**changes):
    b, b_scale = spec_module.quantize_int4_weight(torch.randn(24, 128), 32)
    kwargs = dict(a=torch.randn(4, 128), b=b, b_scale=b_scale, group_size=32, bias=None, act_quant="int8_dynamic")
    kwargs.update(changes)
    return kwargs


U8 = torch.uint8


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"a": torch.zeros(4, 128, dtype=torch.float64)}, "a", "dtype in"),
        ({"a": torch.zeros(4, 128, dtype=torch.int8)}, "a", "dtype in"),
        ({"a": torch.zeros(2, 4, 128)}, "a", "2-d tensor"),
        ({"a": torch.zeros(4, 127)}, "a", "even and >= 2"),
        ({"a": torch.zeros(4, 0)}, "a", "even and >= 2"),
        ({"b": torch.zeros(24, 64, dtype=torch.int8)}, "b", "dtype in {uint8}"),
        ({"b": torch.zeros(24, 128, dtype=U8)}, "b", "shape (N, 64)"),
        ({"b": torch.zeros(64, dtype=U8)}, "b", "2-d tensor"),
        ({"b": torch.zeros(0, 64, dtype=U8)}, "b", "N = b.shape[0] >= 1"),
        ({"b": torch.zeros(24, 64, dtype=U8, device="meta")}, "b", "on cpu"),
        ({"group_size": 48}, "group_size", "a divisor of K = 128"),
        ({"group_size": 0}, "group_size", "an int in [1, 128]"),
        ({"group_size": 256}, "group_size", "an int in [1, 128]"),
        ({"group_size": 32.0}, "group_size", "a Python int"),
        ({"group_size": True}, "group_size", "a Python int"),
        ({"b_scale": torch.ones(24, 4, dtype=torch.float64)}, "b_scale", "dtype in"),
        ({"b_scale": torch.ones(24, 1)}, "b_scale", "shape (24, 4)"),
        ({"b_scale": torch.ones(4, 24, dtype=torch.bfloat16)}, "b_scale", "(N, K / group_size)"),
        ({"b_scale": torch.ones(24, 4, device="meta")}, "b_scale", "on cpu"),
        ({"bias": torch.zeros(24, dtype=torch.bfloat16)}, "bias", "dtype in {float32}"),
        ({"bias": torch.zeros(25)}, "bias", "shape (24,)"),
        ({"bias": torch.zeros(1, 24)}, "bias", "1-d tensor"),
        ({"act_quant": "int8"}, "act_quant", "one of"),
        ({"act_quant": None}, "act_quant", "one of"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "int4_mm"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.a_dtype, key.scale_dtype, key.bias_dtype, key.act_quant) == (
        torch.device("cpu"), torch.float32, torch.bfloat16, None, "int8_dynamic")
    assert (key.n, key.k, key.group_size, key.m_class) == (24, 128, 32, 7)
    # The scale dtype is the key's: an implementation may take bf16 group scales and decline fp32.
    fp32_scales = _good()
    fp32_scales["b_scale"] = fp32_scales["b_scale"].float()
    fp32_key = SPEC.validate(**fp32_scales)  # its rows are 16 bytes, the bf16 ones 8: another layout
    assert fp32_key._replace(b_scale_layout=key.b_scale_layout) == key._replace(scale_dtype=torch.float32)
    assert SPEC.validate(**_good(act_quant="none")) == key._replace(act_quant="none")
    with_bias = SPEC.validate(**_good(bias=torch.zeros(24)))
    assert with_bias.bias_dtype == torch.float32 and with_bias.bias_layout is not None
    # M changes per batch: the key holds its class only (M = 4 and 7: class 7; 9: class 15).
    assert SPEC.validate(**_good(a=torch.randn(7, 128))) == key
    assert SPEC.validate(**_good(a=torch.randn(9, 128))) == key._replace(m_class=15)
    hash(key)


def test_a_strided_view_changes_only_its_layout_field():
    kwargs = _good()
    key = SPEC.validate(**kwargs)
    assert key.a_layout == key.b_layout == Layout(unit_stride=True, alignment=16)
    strided = SPEC.validate(**{**kwargs, "a": torch.randn(4, 256)[:, ::2]})
    assert not strided.a_layout.unit_stride
    assert strided._replace(a_layout=key.a_layout) == key
