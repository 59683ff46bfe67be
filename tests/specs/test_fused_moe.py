"""The fused_moe spec: its reference against an explicit fp64 per-token loop over experts (with
its own blockwise weight dequantization), its validation, fake, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernelmux.errors import DeviceDataError, InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import fused_moe as spec_module
from kernelmux.specs.fused_moe import SPEC
from kernelmux.specs.quantize_fp8 import quantize_fp8

reference = SPEC.reference
FP8_NAME = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


# ---------------------------------------------------------------------------------------------
# The oracle: one token, one (token, slot) pair and one 128 x 128 tile at a time, in float64.


# e2m1 magnitudes by code (OCP MX v1.0, table 5); codes 8..15 are the negatives of 0..7.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4_weight(w: torch.Tensor, scale: torch.Tensor, global_scale, quantization: str) -> torch.Tensor:
    """One expert's packed [N, K/2] codes in fp64, element by element from the format's definition."""
    rows, half = w.shape
    block = 32 if quantization == "mxfp4" else 16
    out = torch.empty(rows, 2 * half, dtype=torch.float64)
    codes = w.tolist()
    scales = scale.float().tolist() if quantization == "nvfp4" else scale.tolist()
    for r in range(rows):
        for j in range(2 * half):
            code = codes[r][j // 2] >> (4 * (j % 2)) & 15  # element 2j in the low nibble
            value = (-1.0 if code & 8 else 1.0) * E2M1[code & 7]
            s = scales[r][j // block]
            if quantization == "mxfp4":
                factor = math.nan if s == 255 else 2.0 ** (s - 127)
            else:
                factor = s / float(global_scale)
            out[r, j] = value * factor
    return out


def _dequant_weight(w: torch.Tensor, scale, quantization: str, global_scale=None) -> torch.Tensor:
    """One expert's [N, K] matrix in fp64, tile by tile for block scales."""
    if quantization == "none":
        return w.double()
    if quantization in ("mxfp4", "nvfp4"):
        return _fp4_weight(w, scale, global_scale, quantization)
    if quantization == "fp8_per_tensor":
        return w.double() * float(scale)
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    for bi in range(math.ceil(rows / 128)):
        for bj in range(math.ceil(cols / 128)):
            r, c = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[r, c] = w[r, c].double() * float(scale[bi, bj])
    return out


def _quant_dequant(x: torch.Tensor, quantization: str, fp8: str) -> torch.Tensor:
    """The op's dynamic activation quantization (quantize_fp8's reference, the spec's quantizer),
    dequantized here group by group in fp64; W4A16 leaves the activations as they are."""
    if quantization in ("none", "mxfp4", "nvfp4"):
        return x.double()
    granularity = "per_group" if quantization == "fp8_block" else "per_tensor"
    q, scale = quantize_fp8(x.float(), granularity, 128, False, fp8)
    out = q.double()
    if granularity == "per_tensor":
        return out * float(scale[0])
    for g in range(scale.shape[1]):
        out[:, g * 128:(g + 1) * 128] *= scale[:, g:g + 1].double()
    return out


def _oracle(kw) -> torch.Tensor:
    hidden, w1, w2 = kw["hidden"], kw["w1"], kw["w2"]
    quantization, dtype = kw["quantization"], hidden.dtype
    fp8 = FP8_NAME.get(w1.dtype, "e4m3fn")
    tokens, hidden_size = hidden.shape
    inter_size = w1.shape[1] // 2
    topk = kw["topk_ids"].shape[1]
    ids, weights = kw["topk_ids"].tolist(), kw["topk_weights"].double().tolist()
    emap = kw["expert_map"].tolist() if kw["expert_map"] is not None else None

    def local(t, j):
        g = ids[t][j]
        return emap[g] if emap is not None else g

    x = hidden.double()
    if kw["apply_router_weight_on_input"]:
        x = x * kw["topk_weights"].double()  # k == 1
        weights = [[1.0] for _ in range(tokens)]
    x = _quant_dequant(x.float(), quantization, fp8)  # w * x is formed in fp32 by contract
    w1d, w2d = {}, {}
    inter = torch.zeros(tokens * topk, inter_size, dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            e = local(t, j)
            if e < 0:
                continue
            if e not in w1d:
                s1 = kw["w1_scale"][e] if kw["w1_scale"] is not None else None
                s2 = kw["w2_scale"][e] if kw["w2_scale"] is not None else None
                g1 = kw["w1_global_scale"][e] if kw["w1_global_scale"] is not None else None
                g2 = kw["w2_global_scale"][e] if kw["w2_global_scale"] is not None else None
                w1d[e] = _dequant_weight(w1[e], s1, quantization, g1)
                w2d[e] = _dequant_weight(w2[e], s2, quantization, g2)
            gate_up = (w1d[e] @ x[t]).to(dtype).double()  # stored in the hidden dtype
            gate, up = gate_up[:inter_size], gate_up[inter_size:]
            if kw["activation"] == "silu":
                act = gate / (1 + torch.exp(-gate))
            else:
                act = 0.5 * gate * (1 + torch.special.erf(gate / math.sqrt(2)))
            inter[t * topk + j] = (act * up).to(dtype).double()
    inter = _quant_dequant(inter.float(), quantization, fp8)
    out = torch.zeros(tokens, hidden_size, dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            e = local(t, j)
            if e >= 0:
                out[t] += weights[t][j] * (w2d[e] @ inter[t * topk + j])
    return out


def _assert_matches_oracle(kw):
    got = reference(**kw)
    want = _oracle(kw)
    assert got.shape == want.shape and got.dtype == kw["hidden"].dtype
    # The oracle differs only by fp64 vs fp32 accumulation, which can flip a rare rounding of a
    # stored intermediate; the spec's own tolerance (scaled by the L2 magnitude) is far below
    # what a wrong expert, slot, weight, half of w1 or scale would produce.
    SPEC.check_close(got, want.to(got.dtype), kw)
    if got.numel():
        mag = spec_module.magnitude(kw)
        err = (got.double() - want).abs()
        if not kw["quantization"].startswith("fp8"):  # no fp8 code can flip: typically far tighter
            rms = lambda v: float(v.square().mean().sqrt())
            assert rms(err) <= 2.0**-8 * rms(mag) + 2.0**-8 * rms(want), (rms(err), rms(mag))


@pytest.mark.parametrize(
    "case", [c for c in SPEC.cases if "model" not in c.tags], ids=lambda c: c.name
)
def test_reference_matches_loop_oracle_on_cases(case):
    _assert_matches_oracle(case.build(seed=5))


def test_expert_map_minus_one_contributes_zero():
    kw = SPEC.case("expert_map_with_holes").build(seed=2)
    full = reference(**kw)
    emap = kw["expert_map"]
    # Dropping every pair whose expert is off-rank (weight 0, id -> any local expert) is the same.
    off = emap.long()[kw["topk_ids"].long()] < 0
    assert bool(off.any())
    local_global = int((emap >= 0).nonzero()[0])
    ids = torch.where(off, torch.tensor(local_global, dtype=torch.int32), kw["topk_ids"])
    # ids in a row stay distinct only if at most one is replaced; the math doesn't care.
    weights = kw["topk_weights"].masked_fill(off, 0.0)
    torch.testing.assert_close(reference(**{**kw, "topk_ids": ids, "topk_weights": weights}),
                               full, rtol=0, atol=0)


def test_all_off_rank_gives_zeros():
    kw = SPEC.case("expert_map_with_holes").build(seed=2)
    kw["expert_map"] = torch.full_like(kw["expert_map"], -1)
    out = reference(**kw)
    assert bool((out == 0).all())


def test_weight_on_input_equals_weight_on_output_for_homogeneous_case():
    # silu is not homogeneous, so the two differ in general; with weight 1 they coincide.
    kw = SPEC.case("top1_weight_on_input").build(seed=1)
    kw["topk_weights"] = torch.ones_like(kw["topk_weights"])
    a = reference(**kw)
    b = reference(**{**kw, "apply_router_weight_on_input": False})
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    kw = SPEC.case("top1_weight_on_input").build(seed=1)
    assert not torch.equal(reference(**kw), reference(**{**kw, "apply_router_weight_on_input": False}))


def test_wrong_expert_is_caught_by_check_close():
    kw = SPEC.case("small_silu").build(seed=4)
    good = reference(**kw)
    bad = reference(**{**kw, "topk_ids": kw["topk_ids"].flip(0).contiguous()})
    with pytest.raises(AssertionError):
        SPEC.check_close(bad, good, kw)
    kw = SPEC.case("small_fp8_block").build(seed=4)
    good = reference(**kw)
    swapped = kw["w1_scale"].flip(0).contiguous()
    bad = reference(**{**kw, "w1_scale": swapped})
    with pytest.raises(AssertionError):
        SPEC.check_close(bad, good, kw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(0, 5),
    experts=st.integers(1, 6),
    hidden_size=st.integers(1, 160),
    inter_size=st.integers(1, 140),
    data=st.data(),
    activation=st.sampled_from(["silu", "gelu"]),
    quantization=st.sampled_from(["none", "fp8_per_tensor", "fp8_block"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    holes=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_loop_oracle_hypothesis(tokens, experts, hidden_size, inter_size, data,
                                                  activation, quantization, dtype, holes, seed):
    topk = data.draw(st.integers(1, experts))
    on_input = topk == 1 and data.draw(st.booleans())
    unmapped = data.draw(st.integers(1, experts - 1)) if holes and experts > 1 else 0
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, dtype=dtype,
                              activation=activation, quantization=quantization,
                              unmapped=unmapped, on_input=on_input)
    kw = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    SPEC.validate(**kw)
    _assert_matches_oracle(kw)


def _meta(kwargs):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**_meta(kwargs))
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")
    SPEC.validate(**kwargs)
    SPEC.validate(**_meta(kwargs))  # validate reads metadata only


def test_cases_cover_the_issue_shapes():
    names = {c.name for c in SPEC.cases}
    assert {"qwen3_30b_a3b_t16_ep16", "mixtral_8x7b_t4_ep8", "deepseek_v3_t16_fp8_block_ep256",
            "gpt_oss_120b_t8_bf16_ep32", "empty", "one_token", "expert_map_with_holes",
            "all_tokens_one_expert", "fp8_block_h_i_not_multiple_of_128"} <= names
    ds = SPEC.case("deepseek_v3_t16_fp8_block_ep256").build()
    assert ds["w1"].shape[1:] == (4096, 7168) and ds["expert_map"].shape == (256,)
    assert ds["topk_ids"].shape[1] == 8 and ds["quantization"] == "fp8_block"
    assert SPEC.cases_tagged("quick")


def test_cost_counts_local_pairs_and_used_experts():
    kw = SPEC.case("small_fp8_block").build()
    cost = SPEC.cost(kw)
    tokens, hidden_size = kw["hidden"].shape
    inter_size = kw["w2"].shape[2]
    used = kw["topk_ids"].unique().numel()
    assert cost.flops == tokens * 2 * 6 * hidden_size * inter_size
    weight_bytes = used * (2 * inter_size * hidden_size + hidden_size * inter_size)
    scale_bytes = used * (kw["w1_scale"][0].numel() + kw["w2_scale"][0].numel()) * 4
    assert cost.bytes == (tokens * hidden_size * 2 * 2 + weight_bytes + scale_bytes
                          + tokens * 2 * 8)
    assert SPEC.cost(SPEC.case("empty").build()).flops == 0


def test_cost_of_fp4_weights_counts_packed_bytes_and_byte_scales():
    kw = SPEC.case("small_nvfp4_gelu_fp16").build()
    cost = SPEC.cost(kw)
    tokens, hidden_size = kw["hidden"].shape
    inter_size, topk = kw["w1"].shape[1] // 2, kw["topk_ids"].shape[1]
    used = kw["topk_ids"].unique().numel()
    weight_bytes = used * 3 * inter_size * hidden_size // 2  # two codes per byte
    scale_bytes = used * (3 * inter_size * hidden_size // 16 + 2 * 4)  # e4m3 per 16, two fp32 gs
    assert cost.bytes == tokens * hidden_size * 2 * 2 + weight_bytes + scale_bytes + tokens * topk * 8
    assert cost.matmul == "bf16" and cost.flops == tokens * topk * 6 * hidden_size * inter_size


def _good(mode="none", **changes):
    quantization = mode
    t, e, h, i, k = 4, 3, 256, 128, 2
    g1 = g2 = None
    if quantization == "none":
        w1, w2, s1, s2 = torch.zeros(e, 2 * i, h, dtype=torch.bfloat16), torch.zeros(e, h, i, dtype=torch.bfloat16), None, None
    elif quantization in ("mxfp4", "nvfp4"):
        block = 32 if quantization == "mxfp4" else 16
        scale_dtype = torch.uint8 if quantization == "mxfp4" else torch.float8_e4m3fn
        w1, w2 = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8), torch.zeros(e, h, i // 2, dtype=torch.uint8)
        s1 = torch.zeros(e, 2 * i, h // block, dtype=scale_dtype)
        s2 = torch.zeros(e, h, i // block, dtype=scale_dtype)
        if quantization == "nvfp4":
            g1, g2 = torch.ones(e), torch.ones(e)
    else:
        w1 = torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn)
        w2 = torch.zeros(e, h, i, dtype=torch.float8_e4m3fn)
        if quantization == "fp8_per_tensor":
            s1, s2 = torch.ones(e), torch.ones(e)
        else:
            s1, s2 = torch.ones(e, 2, 2), torch.ones(e, 2, 1)
    kwargs = dict(hidden=torch.zeros(t, h, dtype=torch.bfloat16), w1=w1, w2=w2,
                  topk_weights=torch.ones(t, k), topk_ids=torch.zeros(t, k, dtype=torch.int32),
                  activation="silu", expert_map=None, apply_router_weight_on_input=False,
                  quantization=mode, w1_scale=s1, w2_scale=s2, w1_global_scale=g1, w2_global_scale=g2)
    kwargs.update(changes)
    return kwargs


BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "mode, changes, argument, fragment",
    [
        ("none", {"hidden": torch.zeros(4, 256)}, "hidden", "dtype in"),
        ("none", {"hidden": torch.zeros(4, 256, 1, dtype=BF16)}, "hidden", "2-d tensor"),
        ("none", {"hidden": [[0.0]]}, "hidden", "torch.Tensor"),
        ("none", {"hidden": torch.zeros(4, 0, dtype=BF16)}, "hidden", "H = hidden.shape[1] >= 1"),
        ("none", {"w1": torch.zeros(3, 256, 256, dtype=torch.float16)}, "w1", "dtype in"),
        ("none", {"w1": torch.zeros(3, 256, 200, dtype=BF16)}, "w1", "(E >= 1, 2I >= 2 even, 256)"),
        ("none", {"w1": torch.zeros(3, 255, 256, dtype=BF16)}, "w1", "2I >= 2 even"),
        ("none", {"w1": torch.zeros(256, 256, dtype=BF16)}, "w1", "3-d tensor"),
        ("none", {"w2": torch.zeros(3, 256, 64, dtype=BF16)}, "w2", "shape (3, 256, 128)"),
        ("none", {"w2": torch.zeros(3, 256, 128, dtype=torch.float16)}, "w2", "dtype in"),
        ("none", {"w2": torch.zeros(3, 256, 128, dtype=BF16, device="meta")}, "w2", "on cpu"),
        ("none", {"topk_weights": torch.ones(4, 2, dtype=BF16)}, "topk_weights", "float32"),
        ("none", {"topk_weights": torch.ones(5, 2)}, "topk_weights", "shape (4, k >= 1)"),
        ("none", {"topk_weights": torch.ones(4, 0), "topk_ids": torch.zeros(4, 0, dtype=torch.int32)},
         "topk_weights", "k >= 1"),
        ("none", {"topk_ids": torch.zeros(4, 2, dtype=torch.int64)}, "topk_ids", "int32"),
        ("none", {"topk_ids": torch.zeros(4, 3, dtype=torch.int32)}, "topk_ids", "shape (4, 2)"),
        ("none", {"topk_weights": torch.ones(4, 4), "topk_ids": torch.zeros(4, 4, dtype=torch.int32)},
         "topk_ids", "k <= 3"),
        ("none", {"activation": "relu"}, "activation", "one of"),
        ("none", {"expert_map": torch.zeros(8, dtype=torch.int64)}, "expert_map", "int32"),
        ("none", {"expert_map": torch.zeros(2, dtype=torch.int32)}, "expert_map", "E_global >= E = 3"),
        ("none", {"apply_router_weight_on_input": 1}, "apply_router_weight_on_input", "a bool"),
        ("none", {"apply_router_weight_on_input": True}, "apply_router_weight_on_input", "k = "),
        ("none", {"quantization": "int4"}, "quantization", "one of"),
        ("none", {"w1_scale": torch.ones(3)}, "w1_scale", "None when quantization is 'none'"),
        ("none", {"w2_scale": torch.ones(3)}, "w2_scale", "None when quantization is 'none'"),
        ("fp8_per_tensor", {"w1": torch.zeros(3, 256, 256, dtype=BF16)}, "w1", "float8"),
        ("fp8_per_tensor", {"w2": torch.zeros(3, 256, 128, dtype=torch.float8_e4m3fnuz)}, "w2", "dtype in"),
        ("fp8_per_tensor", {"w1_scale": None}, "w1_scale", "shape (3,)"),
        ("fp8_per_tensor", {"w1_scale": torch.ones(3, 1)}, "w1_scale", "1-d tensor"),
        ("fp8_per_tensor", {"w2_scale": torch.ones(4)}, "w2_scale", "shape (3,)"),
        ("fp8_per_tensor", {"w2_scale": torch.ones(3, dtype=BF16)}, "w2_scale", "float32"),
        ("fp8_block", {"w1_scale": torch.ones(3, 2, 1)}, "w1_scale", "shape (3, 2, 2)"),
        ("fp8_block", {"w2_scale": torch.ones(3, 1, 2)}, "w2_scale", "shape (3, 2, 1)"),
        ("fp8_block", {"w2_scale": torch.ones(3)}, "w2_scale", "3-d tensor"),
        ("fp8_block", {"w1_scale": torch.ones(3, 2, 2, device="meta")}, "w1_scale", "on cpu"),
        ("mxfp4", {"hidden": torch.zeros(4, 240, dtype=BF16)}, "hidden", "a multiple of 32"),
        ("mxfp4", {"w1": torch.zeros(3, 256, 256, dtype=torch.uint8)}, "w1", "(E >= 1, 2I >= 2 even, 128)"),
        ("mxfp4", {"w1": torch.zeros(3, 256, 128, dtype=torch.float8_e4m3fn)}, "w1", "uint8"),
        ("mxfp4", {"w1": torch.zeros(3, 272, 128, dtype=torch.uint8)}, "w1", "I a multiple of 32"),
        ("mxfp4", {"w2": torch.zeros(3, 256, 128, dtype=torch.uint8)}, "w2", "shape (3, 256, 64)"),
        ("mxfp4", {"w1_scale": torch.zeros(3, 256, 8)}, "w1_scale", "uint8"),
        ("mxfp4", {"w1_scale": torch.zeros(3, 256, 4, dtype=torch.uint8)}, "w1_scale", "shape (3, 256, 8)"),
        ("mxfp4", {"w2_scale": None}, "w2_scale", "[E, H, I/32]"),
        ("mxfp4", {"w1_global_scale": torch.ones(3)}, "w1_global_scale", "None when quantization is 'mxfp4'"),
        ("nvfp4", {"w2_scale": torch.zeros(3, 256, 8, dtype=torch.uint8)}, "w2_scale", "float8_e4m3fn"),
        ("nvfp4", {"w1_scale": torch.zeros(3, 256, 8, dtype=torch.float8_e4m3fn)}, "w1_scale", "shape (3, 256, 16)"),
        ("nvfp4", {"w1_global_scale": None}, "w1_global_scale", "one gs per expert"),
        ("nvfp4", {"w2_global_scale": torch.ones(3, 1)}, "w2_global_scale", "1-d tensor"),
        ("nvfp4", {"w2_global_scale": torch.ones(3, dtype=torch.float64)}, "w2_global_scale", "float32"),
    ],
)
def test_bad_input_names_the_argument(mode, changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(mode, **changes))
    assert info.value.argument == argument
    assert info.value.op == "fused_moe"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def _tokens(t):
    return dict(hidden=torch.zeros(t, 256, dtype=BF16), topk_weights=torch.ones(t, 2),
                topk_ids=torch.zeros(t, 2, dtype=torch.int32))


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.hidden_dtype, key.weight_dtype, key.quantization, key.activation) == (
        torch.device("cpu"), BF16, BF16, "none", "silu")
    assert (key.num_experts, key.num_global_experts, key.hidden_size, key.intermediate_size,
            key.topk) == (3, 3, 256, 128, 2)
    assert (key.expert_map_layout, key.w1_scale_layout, key.w2_scale_layout) == (None, None, None)
    # T changes per batch: the key holds its class only (T = 4 and 7: class 7; 9: class 15).
    assert key.num_tokens_class == 7
    assert key == SPEC.validate(**_good(**_tokens(7)))
    assert SPEC.validate(**_good(**_tokens(9))) == key._replace(num_tokens_class=15)
    assert SPEC.validate(**_good(activation="gelu")) == key._replace(activation="gelu")
    mapped = SPEC.validate(**_good(expert_map=torch.zeros(8, dtype=torch.int32)))
    assert mapped.num_global_experts == 8 and mapped.expert_map_layout is not None
    assert mapped._replace(num_global_experts=3, expert_map_layout=None) == key
    block, per_tensor = SPEC.validate(**_good("fp8_block")), SPEC.validate(**_good("fp8_per_tensor"))
    assert (block.quantization, per_tensor.quantization) == ("fp8_block", "fp8_per_tensor")
    assert block.weight_dtype == torch.float8_e4m3fn and block.w1_scale_layout is not None
    assert block != per_tensor
    hash(key)
    # top-1 with the weight on the input is accepted
    SPEC.validate(**_good(topk_weights=torch.ones(4, 1), topk_ids=torch.zeros(4, 1, dtype=torch.int32),
                          apply_router_weight_on_input=True))


def test_a_misaligned_or_strided_view_changes_only_its_layout_field():
    key = SPEC.validate(**_good())
    assert key.hidden_layout == Layout(unit_stride=True, alignment=16)
    # hidden one element into a wider buffer: rows 257 bf16 (514 bytes) apart.
    shifted = SPEC.validate(**_good(hidden=torch.zeros(4, 257, dtype=BF16)[:, 1:]))
    assert shifted.hidden_layout == Layout(unit_stride=True, alignment=2)
    assert shifted._replace(hidden_layout=key.hidden_layout) == key
    # topk_ids column-major: the k ids of a token are not contiguous.
    strided = SPEC.validate(**_good(topk_ids=torch.zeros(2, 4, dtype=torch.int32).T))
    assert not strided.topk_ids_layout.unit_stride
    assert strided._replace(topk_ids_layout=key.topk_ids_layout) == key


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_check_data_passes_on_every_case(case):
    SPEC.check_data(**case.build())


def _check_data_error(kwargs):
    with pytest.raises(DeviceDataError) as info:
        SPEC.check_data(**kwargs)
    assert info.value.op == "fused_moe"
    return info.value


@pytest.mark.parametrize("case, bad", [
    ("small_silu", 8),  # no map: E_global = E = w1.shape[0] = 8
    ("expert_map_with_holes", 12),  # expert_map.shape[0] = 12 global experts, 7 local
    ("small_silu", -1),  # -1 is the map's marker, never a routed id
])
def test_check_data_rejects_a_routed_id_out_of_range(case, bad):
    kwargs = SPEC.case(case).build()
    kwargs["topk_ids"][2, 1] = bad
    error = _check_data_error(kwargs)
    assert error.argument == "topk_ids"
    assert f"topk_ids[2, 1] = {bad}" in str(error), str(error)
    assert str(kwargs["w1"].shape[0] if kwargs["expert_map"] is None else 12) in error.expected


def test_check_data_rejects_a_token_routed_twice_to_one_expert():
    kwargs = SPEC.case("small_gelu_fp16").build()  # k = 3
    kwargs["topk_ids"][4, 2] = kwargs["topk_ids"][4, 0]
    error = _check_data_error(kwargs)
    assert error.argument == "topk_ids" and "distinct" in error.expected
    assert f"topk_ids[4, 0] = topk_ids[4, 2] = {int(kwargs['topk_ids'][4, 0])}" in str(error)


@pytest.mark.parametrize("bad", [7, -2])  # E_local = 7; -1 is the only negative allowed
def test_check_data_rejects_an_expert_map_entry_out_of_range(bad):
    kwargs = SPEC.case("expert_map_with_holes").build()
    assert kwargs["w1"].shape[0] == 7 and bool((kwargs["expert_map"] == -1).any())
    kwargs["expert_map"][3] = bad
    error = _check_data_error(kwargs)
    assert error.argument == "expert_map" and "[-1, 7)" in error.expected
    assert f"expert_map[3] = {bad}" in str(error), str(error)
