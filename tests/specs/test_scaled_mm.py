"""The scaled_mm spec: its reference against a float64 oracle that applies the scales block by
block, its scale-layout validation, fake, closeness check, cases and cost."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import scaled_mm as spec_module
from kernelmux.specs.quantize_fp8 import quantize_fp8
from kernelmux.specs.scaled_mm import SPEC

reference = SPEC.reference
OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Half an ulp of the output format relative to the value (at most: at a power of two), for 8,
# 11 and 24 significant bits: the reference rounds its fp32 result once.
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}


def _oracle(a, b, scale_a, scale_b, layout, bias):
    """float64 GEMM applying the scales to partial products: per 128 x 128 (row group x channel
    block) tile of K for the block layout, and to the whole dot product otherwise."""
    m, k = a.shape
    n = b.shape[0]
    a64, b64 = a.double(), b.double()
    if layout == "tensor":
        out = (a64 @ b64.T) * scale_a.double().item() * scale_b.double().item()
    elif layout == "channel":
        out = (a64 @ b64.T) * scale_a.double().reshape(m, 1) * scale_b.double().reshape(1, n)
    else:
        out = torch.zeros(m, n, dtype=torch.float64)
        for nb in range(-(-n // 128)):
            channels = slice(nb * 128, min((nb + 1) * 128, n))
            for kb in range(-(-k // 128)):
                cols = slice(kb * 128, min((kb + 1) * 128, k))
                partial = a64[:, cols] @ b64[channels, cols].T
                out[:, channels] += partial * scale_a[:, kb].double().unsqueeze(1) * scale_b[nb, kb].item()
    if bias is not None:
        out = out + bias.double()
    return out


def _magnitude(kwargs):
    deq_a, deq_b = spec_module.dequantize_operands(kwargs["a"], kwargs["b"], kwargs["scale_a"], kwargs["scale_b"])
    mag = deq_a.abs().double() @ deq_b.abs().double().T
    if kwargs["bias"] is not None:
        mag = mag + kwargs["bias"].abs().double()
    return mag


def _assert_matches_oracle(kwargs, layout):
    out = reference(**kwargs)
    assert out.dtype == OUT[kwargs["out_dtype"]]
    assert out.shape == (kwargs["a"].shape[0], kwargs["b"].shape[0])
    exact = _oracle(kwargs["a"], kwargs["b"], kwargs["scale_a"], kwargs["scale_b"], layout, kwargs["bias"])
    # One rounding to the output dtype (half an ulp) plus the fp32 reference's own rounding of
    # the dequantized operands and of the sum: 2^-16 of sum |a||b| is far above that (the products
    # are exact in fp32) and far below any scale-indexing error.
    # 2^-25 is half of fp16's subnormal step.
    bound = (HALF_ULP[kwargs["out_dtype"]] * exact.abs() * (1 + 2.0**-8) + 2.0**-16 * _magnitude(kwargs)
             + 2.0**-25)
    error = (out.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error / bound {float((error / bound).max()):.3g}"


@pytest.mark.parametrize(
    "case", [c for c in SPEC.cases if c.tags & {"random", "edge"} or c.name.endswith("m1_n7168_k2048")
             or c.name == "llama3_8b_m1_per_token"], ids=lambda c: c.name)
def test_reference_matches_float64_oracle_on_cases(case):
    kwargs = case.build(seed=5)
    layout = SPEC.validate(**kwargs)[2]
    _assert_matches_oracle(kwargs, layout)


@given(
    m=st.integers(0, 9),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    layout=st.sampled_from(spec_module.LAYOUTS),
    out_dtype=st.sampled_from(list(OUT)),
    with_bias=st.booleans(),
    ue8m0=st.booleans(),
    fp8_dtype=st.sampled_from(["e4m3fn", "e4m3fnuz"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_float64_oracle_on_drawn_shapes(m, n, k, layout, out_dtype, with_bias,
                                                         ue8m0, fp8_dtype, seed):
    make = spec_module._maker(m, n, k, layout, out_dtype=out_dtype, with_bias=with_bias,
                              ue8m0=ue8m0, fp8_dtype=fp8_dtype)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    _assert_matches_oracle(kwargs, SPEC.validate(**kwargs)[2])
    fake = SPEC.fake(**{k_: v.to("meta") if isinstance(v, torch.Tensor) else v for k_, v in kwargs.items()})
    assert (fake.shape, fake.dtype) == (reference(**kwargs).shape, OUT[out_dtype])


def test_hand_worked_block_scales_apply_per_block():
    # a = ones [1, 256], b = ones [2, 256] (N = 2: one channel block; K: two blocks). Block sums
    # are 128 each; scale_a = [1, 2], scale_b = [[3, 5]]: out = 128 * 1 * 3 + 128 * 2 * 5 = 1664.
    a = torch.ones(1, 256).to(torch.float8_e4m3fn)
    b = torch.ones(2, 256).to(torch.float8_e4m3fn)
    out = reference(a, b, torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 5.0]]), "float32")
    assert out.tolist() == [[1664.0, 1664.0]]
    # Per-channel: channel 1 scaled by 4, plus a bias.
    out = reference(a, b, torch.tensor([[0.5]]), torch.tensor([[1.0], [4.0]]), "float32",
                    torch.tensor([1.0, -1.0]))
    assert out.tolist() == [[129.0, 511.0]]


def test_reference_rounds_once_to_the_output_dtype():
    # 1 + 2^-9 is not a bf16 value (bf16 steps by 2^-7 there): it rounds to 1.0. With a bias of
    # 2^-8 added in fp32 first, 1 + 3 * 2^-9 rounds once to 1 + 2^-7; rounding the product first
    # would give 1 + 2^-8, a tie that rounds to even, 1.0.
    a = torch.tensor([[1.0, 2.0**-9]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[1.0, 1.0]]).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    assert reference(a, b, one, one, "bfloat16").item() == 1.0
    bias = torch.tensor([2.0**-8], dtype=torch.bfloat16)
    assert reference(a, b, one, one, "bfloat16", bias).item() == 1.0 + 2.0**-7


def test_cases_use_quantize_fp8_operands():
    kwargs = SPEC.case("small_block").build(seed=1)
    assert kwargs["a"].dtype == torch.float8_e4m3fn and kwargs["scale_a"].shape == (9, 3)
    assert kwargs["scale_b"].shape == (2, 3)
    # The weight blocks: each 128 x 128 block is quantized to its own amax / 448.
    q, scale = spec_module.quantize_weight_blocks(torch.arange(200 * 130, dtype=torch.float32).view(200, 130))
    assert q.shape == (200, 130) and scale.shape == (2, 2)
    assert scale[1, 1].item() == torch.tensor(199 * 130 + 129.0) .div(448.0).item()
    block = torch.arange(200 * 130, dtype=torch.float32).view(200, 130)[128:, 128:]
    q_block, s_block = quantize_fp8(block, "per_tensor")
    assert torch.equal(q[128:, 128:].view(torch.uint8), q_block.view(torch.uint8))


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fake = SPEC.fake(**meta)
    SPEC.validate(**kwargs)
    if "model" in case.tags and "quick" not in case.tags:
        # The big cases' reference runs in the conformance suite; here shape arithmetic suffices.
        expected = (kwargs["a"].shape[0], kwargs["b"].shape[0])
        assert (tuple(fake.shape), fake.dtype) == (expected, OUT[kwargs["out_dtype"]])
        return
    real = reference(**kwargs)
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")
    SPEC.check_close(real, reference(**kwargs), kwargs)


def test_check_close_allows_accumulation_order_and_rejects_a_wrong_block():
    kwargs = SPEC.case("deepseek_v3_m1_n2048_k7168").build(seed=2)
    expected = reference(**kwargs)
    # A kernel-like formulation: fp32 partial sums per K block, scaled, accumulated in order.
    a, b = kwargs["a"].float(), kwargs["b"].float()
    acc = torch.zeros(a.shape[0], b.shape[0])
    for kb in range(7168 // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        sb = kwargs["scale_b"][:, kb].repeat_interleave(128)
        acc += (a[:, cols] @ b[:, cols].T) * kwargs["scale_a"][:, kb:kb + 1] * sb
    SPEC.check_close(acc.to(torch.bfloat16), expected, kwargs)
    # Using the neighbouring K block's activation scale for the last block is a real bug shape.
    wrong = acc - (a[:, -128:] @ b[:, -128:].T) * (kwargs["scale_a"][:, -1:] - kwargs["scale_a"][:, -2:-1]) * \
        kwargs["scale_b"][:, -1].repeat_interleave(128)
    with pytest.raises(AssertionError, match=r"scaled_mm: \d+ of 2048 elements outside"):
        SPEC.check_close(wrong.to(torch.bfloat16), expected, kwargs)
    with pytest.raises(AssertionError, match="float16"):
        SPEC.check_close(acc.to(torch.float16), expected, kwargs)


def test_cases_cover_the_issue_shapes():
    names = {c.name for c in SPEC.cases}
    assert {f"deepseek_v3_m{m}_n{n}_k{k}" for m in (1, 64, 1024)
            for n, k in ((7168, 2048), (2048, 7168))} <= names
    assert {"llama3_8b_m1024_per_token", "empty_block", "one_token_block",
            "k_not_multiple_of_128_block", "n_not_multiple_of_128_block"} <= names
    layouts = {SPEC.validate(**c.build())[2] for c in SPEC.cases_tagged("random")}
    assert layouts == set(spec_module.LAYOUTS)


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("small_block_bias_fp32").build()
    cost = SPEC.cost(kwargs)
    assert cost.flops == 2 * 4 * 128 * 256
    assert cost.bytes == 4 * 256 + 128 * 256 + (4 * 2 + 1 * 2) * 4 + 4 * 128 * 4 + 128 * 4


def _good(**changes):
    a, scale_a = quantize_fp8(torch.randn(4, 256), "per_group")
    b, scale_b = spec_module.quantize_weight_blocks(torch.randn(200, 256))
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype="bfloat16", bias=None)
    kwargs.update(changes)
    return kwargs


E4 = torch.float8_e4m3fn
FP32 = torch.float32


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"a": torch.zeros(4, 256, dtype=torch.bfloat16)}, "a", "dtype in"),
        ({"a": torch.zeros(2, 4, 256, dtype=E4)}, "a", "2-d tensor"),
        ({"a": torch.zeros(4, 0, dtype=E4)}, "a", "K = a.shape[1] >= 1"),
        ({"b": torch.zeros(200, 256, dtype=torch.float8_e4m3fnuz)}, "b", "the dtype of a"),
        ({"b": torch.zeros(200, 256, dtype=torch.float8_e5m2)}, "b", "dtype in"),
        ({"b": torch.zeros(256, dtype=E4)}, "b", "2-d tensor"),
        ({"b": torch.zeros(200, 128, dtype=E4)}, "b", "shape (N, 256)"),
        ({"b": torch.zeros(300, 200, dtype=E4).T}, "b", "shape (N, 256)"),
        ({"b": torch.zeros(200, 256, dtype=E4, device="meta")}, "b", "on cpu"),
        ({"scale_a": torch.ones(4, 2, dtype=torch.bfloat16)}, "scale_a", "dtype float32"),
        ({"scale_a": torch.ones(4, 3)}, "scale_a", "(4, 2) (block)"),
        ({"scale_a": torch.ones(2)}, "scale_a", "() or (1,) (tensor)"),
        ({"scale_a": torch.ones(1, 4, 2)}, "scale_a", "(4, 1) (channel)"),
        ({"scale_a": torch.ones(4, 2, device="meta")}, "scale_a", "on cpu"),
        ({"scale_b": torch.ones(200, 2)}, "scale_b", "(2, 2) (block)"),
        ({"scale_b": torch.ones(200, 1)}, "scale_b", "the layout of scale_a"),
        ({"scale_a": torch.ones(1), "scale_b": torch.ones(200, 1)}, "scale_b", "a and b must use the same"),
        ({"scale_a": torch.ones(4, 1), "scale_b": torch.ones(())}, "scale_b", "(200, 1) (channel)"),
        ({"out_dtype": "fp8"}, "out_dtype", "one of"),
        ({"out_dtype": torch.bfloat16}, "out_dtype", "one of"),
        ({"bias": torch.zeros(200, dtype=torch.float32)}, "bias", "dtype in {bfloat16}"),
        ({"bias": torch.zeros(201, dtype=torch.bfloat16)}, "bias", "shape (200,)"),
        ({"bias": torch.zeros(1, 200, dtype=torch.bfloat16)}, "bias", "1-d tensor"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "scaled_mm"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_layouts_are_identified_from_the_shapes():
    a, b = torch.zeros(4, 256, dtype=E4), torch.zeros(200, 256, dtype=E4)
    layout = spec_module.scale_layout
    assert layout(a, b, torch.ones(()), torch.ones(1)) == "tensor"
    assert layout(a, b, torch.ones(4, 1), torch.ones(200, 1)) == "channel"
    assert layout(a, b, torch.ones(4, 2), torch.ones(2, 2)) == "block"
    # K <= 128 and N == 1: channel and block shapes coincide, and mean the same product.
    a1, b1 = torch.zeros(4, 100, dtype=E4), torch.zeros(1, 100, dtype=E4)
    assert layout(a1, b1, torch.ones(4, 1), torch.ones(1, 1)) == "channel"


@given(m=st.integers(0, 9), n=st.integers(1, 300), k=st.integers(1, 300), layout=st.sampled_from(spec_module.LAYOUTS),
       scalar=st.booleans())
def test_validated_scaling_agrees_with_scale_layout(m, n, k, layout, scalar):
    # The implementations' cheap reading of a validated call's layout, against the spec's own.
    make = spec_module._maker(m, n, k, layout, scalar_scales=scalar and layout == "tensor")
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(m * 1000 + n + k))
    a, b, scale_a, scale_b = kwargs["a"], kwargs["b"], kwargs["scale_a"], kwargs["scale_b"]
    assert spec_module.validated_scaling(scale_a, scale_b, n) == spec_module.scale_layout(a, b, scale_a, scale_b)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.fp8_dtype, key.scaling, key.n, key.k) == (
        torch.device("cpu"), E4, "block", 200, 256)
    assert (key.out_dtype, key.bias_dtype, key.bias_layout) == ("bfloat16", None, None)
    assert key != SPEC.validate(**_good(out_dtype="float32"))
    with_bias = SPEC.validate(**_good(bias=torch.zeros(200, dtype=torch.bfloat16)))
    assert with_bias.bias_dtype == torch.bfloat16 and with_bias.bias_layout is not None
    # M changes per batch: the key holds its class only (M = 4 and 7: class 7; 9: class 15).
    assert key.m_class == 7
    a, scale_a = quantize_fp8(torch.randn(7, 256), "per_group")
    assert key == SPEC.validate(**_good(a=a, scale_a=scale_a))
    a, scale_a = quantize_fp8(torch.randn(9, 256), "per_group")
    assert SPEC.validate(**_good(a=a, scale_a=scale_a)) == key._replace(m_class=15)
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_its_layout_field():
    kwargs = _good()
    key = SPEC.validate(**kwargs)
    assert key.a_layout == key.b_layout == Layout(unit_stride=True, alignment=16)
    # a one byte into a wider buffer: rows start 257 bytes apart, so nothing is aligned.
    shifted = SPEC.validate(**{**kwargs, "a": torch.zeros(4, 257, dtype=E4)[:, 1:]})
    assert shifted.a_layout == Layout(unit_stride=True, alignment=1)
    assert shifted._replace(a_layout=key.a_layout) == key
    # b stored column-major (a transposed weight): K is not the contiguous dim.
    strided = SPEC.validate(**{**kwargs, "b": kwargs["b"].T.contiguous().T})
    assert not strided.b_layout.unit_stride
    assert strided._replace(b_layout=key.b_layout) == key
