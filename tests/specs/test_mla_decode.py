"""The mla_decode spec: its reference against the un-absorbed MLA formulation, against dense SDPA
on independently gathered latents, lse against logsumexp; causal MTP masking, fp8 caches,
validation, fake, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close
from kernelmux.specs._spec import Tolerance
from kernelmux.specs import mla_decode as spec_module
from kernelmux.specs.mla_decode import SPEC

reference = SPEC.reference
FP8 = torch.float8_e4m3fn


def _gather(kwargs, b: int) -> torch.Tensor:
    """Sequence b's latent rows [L, D] fp64, one position at a time (not the reference's reshape)."""
    cache, row = kwargs["kv_cache"], kwargs["block_table"][b]
    length, block_size = int(kwargs["seq_lens"][b]), cache.shape[1]
    rows = [cache[int(row[j // block_size]), j % block_size].double() for j in range(length)]
    out = torch.stack(rows) if rows else torch.zeros(0, cache.shape[2], dtype=torch.float64)
    scale = kwargs["kv_scale"]
    return out * (float(scale.item()) if scale is not None else 1.0)


def _mask(q_len: int, kv_len: int) -> torch.Tensor:
    return torch.tensor([[j <= kv_len - q_len + i for j in range(kv_len)] for i in range(q_len)],
                        dtype=torch.bool).reshape(q_len, kv_len)


def sdpa_oracle(kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense SDPA in fp64 with 576-wide keys and 512-wide values, and logsumexp of the scores."""
    q_all, rank, scale = kwargs["q"], kwargs["kv_lora_rank"], kwargs["scale"]
    out = torch.zeros(*q_all.shape[:2], rank, dtype=torch.float64)
    lse = torch.zeros(q_all.shape[:2], dtype=torch.float64)
    cu = kwargs["cu_seqlens_q"].tolist()
    for b in range(len(cu) - 1):
        if cu[b + 1] == cu[b]:
            continue
        q = q_all[cu[b]:cu[b + 1]].double().transpose(0, 1)  # [H, q, D]
        kv = _gather(kwargs, b)
        mask = _mask(q.shape[1], kv.shape[0])
        heads = q.shape[0]
        k = kv[None].expand(heads, -1, -1)
        v = kv[None, :, :rank].expand(heads, -1, -1)
        out[cu[b]:cu[b + 1]] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                              scale=scale).transpose(0, 1)
        s = (q @ kv.T * scale).masked_fill(~mask, float("-inf"))
        lse[cu[b]:cu[b + 1]] = torch.logsumexp(s, -1).transpose(0, 1)
    return out, lse


def _rounding(dtype: torch.dtype) -> Tolerance:
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    return Tolerance(atol=1e-5, rtol=unit * 1.01)


LSE_FP32 = Tolerance(atol=2e-5, rtol=2e-6)  # the reference's lse is fp32 math on exact inputs

ORACLE_CASES = [c for c in SPEC.cases if "model" not in c.tags or c.name in (
    "deepseek_v3_h16_decode_b8_ctx512", "deepseek_v3_h128_mtp4_b8_ctx512",
    "deepseek_v3_h16_mtp_mixed", "deepseek_v3_h128_fp8_mtp2_b8_ctx512")]


def _check_against_oracle(kwargs, what):
    out, lse = reference(**kwargs)
    expected_out, expected_lse = sdpa_oracle(kwargs)
    assert_close(out, expected_out, _rounding(kwargs["q"].dtype), what + " out")
    if kwargs["return_lse"]:
        assert_close(lse, expected_lse, LSE_FP32, what + " lse")
    else:
        assert lse.shape == (0,) and lse.dtype == torch.float32


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c.name)
def test_reference_matches_dense_attention_and_logsumexp(case):
    _check_against_oracle(case.build(seed=1), case.name)


def test_reference_matches_unabsorbed_mla():
    # Un-absorbed MLA per head h: k_h = [c_kv W_UK[h], k_pe], v_h = c_kv W_UV[h], query
    # [q_nope_h, q_pe]; out_h = softmax(scale (q_nope k_nope^T + q_pe k_pe^T)) v_h. Absorbed: the
    # query's first r dims are q_nope_h W_UK[h]^T and out_h = (reference's latent out) W_UV[h].
    g = torch.Generator().manual_seed(5)
    rank, rope, d_nope, d_v, heads, block_size, scale = 16, 4, 6, 5, 3, 4, 0.03
    kwargs = spec_module._maker((1, 3, 2), (7, 9, 2), heads, rank + rope, rank, block_size,
                                scale=scale)(torch.device("cpu"), g)
    # Small integers make the absorbed query q_nope W_UK^T exact in bf16 (|entries| <= 24), so
    # both sides see the same scores and only the reference's final bf16 rounding differs.
    w_uk = torch.randint(-2, 3, (heads, rank, d_nope), generator=g).double()
    q_nope = torch.randint(-2, 3, (kwargs["q"].shape[0], heads, d_nope), generator=g).double()
    w_uv = torch.randn(heads, rank, d_v, generator=g, dtype=torch.float64) / 4
    q_pe = kwargs["q"][..., rank:].double()
    absorbed = torch.einsum("thn,hrn->thr", q_nope, w_uk)
    assert torch.equal(absorbed.to(torch.bfloat16).double(), absorbed)
    kwargs["q"] = torch.cat([absorbed.to(torch.bfloat16), kwargs["q"][..., rank:]], dim=-1)
    out_latent, _ = reference(**kwargs)
    cu = kwargs["cu_seqlens_q"].tolist()
    for b in range(3):
        c = _gather(kwargs, b)
        c_kv, k_pe = c[:, :rank], c[:, rank:]
        rows = slice(cu[b], cu[b + 1])
        mask = _mask(cu[b + 1] - cu[b], c.shape[0])
        for h in range(heads):
            k_nope = c_kv @ w_uk[h]  # [L, d_nope]
            v = c_kv @ w_uv[h]  # [L, d_v]
            s = q_nope[rows, h] @ k_nope.T + q_pe[rows, h] @ k_pe.T
            p = torch.softmax((s * scale).masked_fill(~mask, float("-inf")), -1)
            expected = p @ v
            got = out_latent[rows, h].double() @ w_uv[h]
            # The latent output's bf16 rounding (2^-9 relative per element) through W_UV.
            bound = 2**-9 * (out_latent[rows, h].double().abs() @ w_uv[h].abs()) + 1e-6
            assert ((got - expected).abs() <= bound).all(), (b, h, (got - expected).abs().max())
            # And the scores really mix nope and rope terms (neither side is negligible).
            assert (q_pe[rows, h] @ k_pe.T).abs().max() > 0.1 and s.abs().max() > 1


def test_unabsorbed_identity_is_exact_in_fp64():
    # The algebra itself, without bf16 rounding: q_nope . (c W_UK)^T == (q_nope W_UK^T) . c^T.
    g = torch.Generator().manual_seed(2)
    q_nope = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w_uk = torch.randn(16, 6, generator=g, dtype=torch.float64)
    c = torch.randn(9, 16, generator=g, dtype=torch.float64)
    assert torch.allclose(q_nope @ (c @ w_uk).T, (q_nope @ w_uk.T) @ c.T, rtol=1e-12, atol=1e-12)


@settings(deadline=None, max_examples=60)
@given(
    q_kv=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 20)), min_size=0, max_size=4),
    heads=st.integers(1, 5),
    dims=st.sampled_from([(8, 8), (12, 8), (24, 16), (40, 32)]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    return_lse=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_sdpa_on_drawn_shapes(q_kv, heads, dims, block_size, dtype, fp8,
                                                return_lse, seed):
    q_lens = tuple(min(q, kv) for q, kv in q_kv if kv > 0)
    kv_lens = tuple(kv for _, kv in q_kv if kv > 0)
    make = spec_module._maker(q_lens, kv_lens, heads, dims[0], dims[1], block_size, dtype,
                              FP8 if fp8 else None, kv_scale=0.3 if fp8 else None,
                              scale=0.1 if fp8 else None, return_lse=return_lse)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    _check_against_oracle(kwargs, "drawn")
    _assert_fake_matches(kwargs, reference(**kwargs))


def test_causal_convention_for_mtp():
    # 3 queries at the end of a 5-long sequence sit at positions 2, 3, 4. q = 0 gives equal scores;
    # latent value dim 0 = position, so each output is the mean visible position.
    cache = torch.zeros(2, 4, 3, dtype=torch.bfloat16)
    cache[..., 0] = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    args = dict(q=torch.zeros(3, 1, 3, dtype=torch.bfloat16), kv_cache=cache,
                cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                seq_lens=torch.tensor([5], dtype=torch.int32), max_query_len=3, max_seq_len=5,
                scale=1.0, kv_lora_rank=2, return_lse=True)
    out, lse = reference(**args)
    assert out[:, 0, 0].tolist() == [1.0, 1.5, 2.0]  # mean(0..2), mean(0..3), mean(0..4)
    assert out.shape == (3, 1, 2)
    assert torch.allclose(lse[:, 0], torch.log(torch.tensor([3.0, 4.0, 5.0])))


def test_hand_worked_scores_use_rope_dims_and_values_do_not():
    # D = 2, r = 1. Keys (0, 0) and (0, ln 2): only the rope dim differs; q = (0, 1), scale 1:
    # p = (1/3, 2/3); values are dim 0 only: 1 and 4 -> 3. lse = ln 3.
    cache = torch.zeros(1, 2, 2, dtype=torch.float16)
    cache[0, 0] = torch.tensor([1.0, 0.0])
    cache[0, 1] = torch.tensor([4.0, math.log(2)])
    args = dict(q=torch.tensor([[[0.0, 1.0]]], dtype=torch.float16), kv_cache=cache,
                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                block_table=torch.tensor([[0]], dtype=torch.int32),
                seq_lens=torch.tensor([2], dtype=torch.int32), max_query_len=1, max_seq_len=2,
                scale=1.0, kv_lora_rank=1, return_lse=True)
    out, lse = reference(**args)
    ln2 = float(torch.tensor(math.log(2), dtype=torch.float16))
    p = torch.softmax(torch.tensor([0.0, ln2]), 0)
    assert out.item() == pytest.approx(float(p[0] + 4 * p[1]), rel=1e-3)
    assert lse.item() == pytest.approx(math.log(1 + math.exp(ln2)), rel=1e-6)


def test_fp8_cache_equals_dequantized_bf16_cache():
    kwargs = SPEC.case("small_fp8").build(seed=4)
    kwargs["kv_scale"] = torch.tensor(0.25)  # a power of two: code * scale is exact in bf16
    dequantized = dict(kwargs, kv_scale=None,
                       kv_cache=(kwargs["kv_cache"].float() * 0.25).to(torch.bfloat16))
    for got, want in zip(reference(**kwargs), reference(**dequantized)):
        assert torch.equal(got, want)


def test_output_ignores_unread_memory_and_table_entries():
    kwargs = SPEC.case("table_slack_permuted").build(seed=2)
    before = reference(**kwargs)
    kwargs = SPEC.case("nan_in_unused_slots").build(seed=2)
    out, lse = reference(**kwargs)
    assert not out.isnan().any() and not lse.isnan().any()
    table = kwargs["block_table"].clone()
    for b, kv_len in enumerate(kwargs["seq_lens"].tolist()):
        table[b, -(-kv_len // 64):] = 10**6  # never read
    again = reference(**dict(kwargs, block_table=table))
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    assert before[0].shape == (2, 16, 512)


def test_lse_off_is_empty_and_out_unchanged():
    kwargs = SPEC.case("small_decode").build(seed=6)
    on = reference(**kwargs)
    off = reference(**dict(kwargs, return_lse=False))
    assert torch.equal(on[0], off[0]) and off[1].shape == (0,) and off[1].dtype == torch.float32


def _assert_fake_matches(kwargs, real):
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fake = SPEC.fake(**meta)
    assert isinstance(fake, tuple) and len(fake) == 2
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.stride(), f.device.type) == (r.shape, r.dtype, r.stride(), "meta")


# gpu-tagged cases are GB-sized: the reference runs them in the GPU suite (conformance), not here.
@pytest.mark.parametrize("case", [c for c in SPEC.cases if "gpu" not in c.tags], ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    _assert_fake_matches(kwargs, real)
    SPEC.validate(**kwargs)
    SPEC.check_close(real, tuple(t.clone() for t in real), kwargs)
    assert not real[0].isnan().any() and not real[1].isnan().any()


def test_check_close_catches_a_wrong_lse_base():
    kwargs = SPEC.case("small_decode").build(seed=1)
    out, lse = reference(**kwargs)
    with pytest.raises(AssertionError, match="lse"):
        SPEC.check_close((out, lse / math.log(2)), (out, lse), kwargs)
    with pytest.raises(AssertionError, match="out"):
        SPEC.check_close((out * 1.1, lse), (out, lse), kwargs)


def test_cases_cover_the_brief():
    names = {c.name for c in SPEC.cases}
    for heads in (128, 16):
        for b in (1, 8, 64):
            for ctx in (512, 4096):
                assert f"deepseek_v3_h{heads}_decode_b{b}_ctx{ctx}" in names
    assert {"empty_batch", "seq_len_1", "partial_blocks", "table_slack_permuted",
            "nan_in_unused_slots", "deepseek_v3_h16_fp8_decode_b8_ctx4096"} <= names
    for tag in ("model", "random", "edge", "quick"):
        assert SPEC.cases_tagged(tag), tag
    kwargs = SPEC.case("deepseek_v3_h128_decode_b8_ctx4096").build()
    assert kwargs["q"].shape == (8, 128, 576) and kwargs["kv_cache"].shape[1:] == (64, 576)
    mtp = SPEC.case("deepseek_v3_h128_mtp4_b8_ctx512").build()
    assert mtp["q"].shape[0] == 32 and mtp["max_query_len"] == 4


def test_cost_counts_causal_pairs_and_latent_rows_once():
    kwargs = SPEC.case("small_mtp_fp16").build()  # q (3, 2, 1), kv (9, 2, 20), H 3, D 24, r 16
    pairs = (7 + 8 + 9) + (1 + 2) + 20
    cost = SPEC.cost(kwargs)
    assert cost.flops == 2 * (24 + 16) * 3 * pairs
    q_bytes = 6 * 3 * 24 * 2
    out_bytes = 6 * 3 * (16 * 2 + 4)
    metadata = 4 * 4 + 3 * 4 + (3 + 1 + 5) * 4
    assert cost.bytes == q_bytes + out_bytes + (9 + 2 + 20) * 24 * 2 + metadata


def _good(**changes):
    kwargs = SPEC.case("small_fp8").build()
    kwargs.update(changes)
    return kwargs


_I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"q": torch.zeros(3, 4, 40)}, "q", "dtype in"),
        ({"q": torch.zeros(3, 160, dtype=torch.bfloat16)}, "q", "3-d tensor"),
        ({"q": [[0.0]]}, "q", "torch.Tensor"),
        ({"kv_cache": torch.zeros(9, 8, 40, dtype=torch.float16)}, "kv_cache", "dtype in"),
        ({"kv_cache": torch.zeros(9, 8, 1, 40, dtype=FP8)}, "kv_cache", "3-d tensor"),
        ({"kv_cache": torch.zeros(9, 8, 32, dtype=FP8)}, "kv_cache", "row width D = 40"),
        ({"kv_cache": torch.zeros(9, 8, 40, dtype=FP8, device="meta")}, "kv_cache", "on cpu"),
        ({"cu_seqlens_q": torch.tensor([0, 1, 3])}, "cu_seqlens_q", "dtype in"),
        ({"cu_seqlens_q": torch.zeros(0, **_I32)}, "cu_seqlens_q", "B+1"),
        ({"cu_seqlens_q": torch.tensor([0, 3], **_I32)}, "block_table", "1 rows"),
        ({"block_table": torch.zeros(2, 4)}, "block_table", "dtype in"),
        ({"block_table": torch.zeros(8, **_I32)}, "block_table", "2-d tensor"),
        ({"seq_lens": torch.tensor([19, 6])}, "seq_lens", "dtype in"),
        ({"seq_lens": torch.tensor([19], **_I32)}, "seq_lens", "shape (2,)"),
        ({"max_query_len": 2.0}, "max_query_len", "a Python int"),
        ({"max_seq_len": -1}, "max_seq_len", ">= 0"),
        ({"scale": torch.tensor(0.1)}, "scale", "float"),
        ({"kv_lora_rank": 41}, "kv_lora_rank", "[1, 40]"),
        ({"kv_lora_rank": 0}, "kv_lora_rank", "[1, 40]"),
        ({"kv_lora_rank": 32.0}, "kv_lora_rank", "a Python int"),
        ({"kv_scale": 0.3}, "kv_scale", "torch.Tensor"),
        ({"kv_scale": torch.ones(2)}, "kv_scale", "shape () or (1,)"),
        ({"kv_scale": torch.ones((), dtype=torch.float64)}, "kv_scale", "fp32"),
        ({"return_lse": 1}, "return_lse", "a bool"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "mla_decode"
    assert fragment in str(info.value), str(info.value)


def test_scale_rejected_for_bf16_cache():
    kwargs = SPEC.case("small_decode").build()
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**dict(kwargs, kv_scale=torch.ones(())))
    assert info.value.argument == "kv_scale"


def test_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    # The longest context enters as its power-of-two class: it buckets tuning tables.
    assert key == SPEC.validate(**_good(max_seq_len=(key.max_seq_len_class + 1) // 2 + 1))
    assert key != SPEC.validate(**_good(max_seq_len=4 * key.max_seq_len_class + 8))
    assert key != SPEC.validate(**_good(return_lse=False))
    assert key != SPEC.validate(**_good(kv_scale=None))
    assert key != SPEC.validate(**_good(max_query_len=3))
    uniform = SPEC.case("deepseek_v3_h128_mtp4_b8_ctx512").build()
    assert SPEC.validate(**uniform).uniform_queries is True
    assert SPEC.validate(**SPEC.case("deepseek_v3_h16_mtp_mixed").build()).uniform_queries is False
