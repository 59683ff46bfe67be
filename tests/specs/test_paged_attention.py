"""The paged_attention spec: its reference against dense SDPA on independently gathered KV and
against explicit soft-cap / sink formulas, its validation, fake, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close
from kernelmux.specs._spec import Tolerance
from kernelmux.specs import paged_attention as spec_module
from kernelmux.specs.paged_attention import SPEC

reference = SPEC.reference
FP8 = torch.float8_e4m3fn


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int, scale) -> torch.Tensor:
    """[length, Hkv, D] fp64, one position at a time (not the reference's block reshape)."""
    block_size = cache.shape[1]
    rows = [cache[int(table_row[j // block_size]), j % block_size].double() for j in range(length)]
    out = torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]), dtype=torch.float64)
    return out * (float(scale.item()) if scale is not None else 1.0)


def _mask(q_len: int, kv_len: int, causal: bool, window: int) -> torch.Tensor:
    """[q_len, kv_len] True where visible, written out element by element."""
    rows = []
    for i in range(q_len):
        position = kv_len - q_len + i
        rows.append([(j <= position or not causal) and (window == 0 or position - j < window)
                     for j in range(kv_len)])
    return torch.tensor(rows, dtype=torch.bool).reshape(q_len, kv_len)


def _per_sequence(kwargs):
    """(query rows [q, Hq, D] fp64, K, V [L, Hq, D] fp64 with kv heads expanded, mask) per sequence."""
    q_all = kwargs["query"]
    num_heads, num_kv_heads = q_all.shape[1], kwargs["k_cache"].shape[2]
    cu = kwargs["cu_seqlens_q"].tolist()
    for b, kv_len in enumerate(kwargs["seq_lens"].tolist()):
        q = q_all[cu[b]:cu[b + 1]].double()
        k = _gather(kwargs["k_cache"], kwargs["block_table"][b], kv_len, kwargs["k_scale"])
        v = _gather(kwargs["v_cache"], kwargs["block_table"][b], kv_len, kwargs["v_scale"])
        group = num_heads // num_kv_heads
        # GQA: query head h reads kv head h // group; built with an explicit index, not repeat.
        heads = torch.tensor([h // group for h in range(num_heads)])
        mask = _mask(q.shape[0], kv_len, kwargs["causal"], kwargs["sliding_window"])
        yield cu[b], cu[b + 1], q, k[:, heads], v[:, heads], mask


def sdpa_oracle(kwargs) -> torch.Tensor:
    """Dense attention per sequence with torch SDPA in fp64 (no soft cap, no sinks)."""
    assert kwargs["logits_soft_cap"] == 0 and kwargs["sinks"] is None
    out = torch.zeros(kwargs["query"].shape, dtype=torch.float64)
    for start, end, q, k, v, mask in _per_sequence(kwargs):
        if end == start:
            continue
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=kwargs["scale"])
        out[start:end] = o.transpose(0, 1)
    return out


def formula_oracle(kwargs) -> torch.Tensor:
    """softmax with soft cap and sinks written out: p_j = e^{s_j} / (e^{sink} + sum_k e^{s_k})."""
    out = torch.zeros(kwargs["query"].shape, dtype=torch.float64)
    cap, sinks = kwargs["logits_soft_cap"], kwargs["sinks"]
    for start, end, q, k, v, mask in _per_sequence(kwargs):
        s = torch.einsum("ihd,jhd->hij", q, k) * kwargs["scale"]  # [Hq, q_len, kv_len]
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        e = torch.where(mask, torch.exp(s), torch.zeros_like(s))  # scores are O(10): no overflow
        denominator = e.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + torch.exp(sinks.double())[:, None, None]
        out[start:end] = torch.einsum("hij,jhd->ihd", e / denominator, v)
    return out


def _bf16_rounding(dtype: torch.dtype) -> Tolerance:
    # The reference is fp32 math rounded once to the output dtype: within half an ulp (plus fp32
    # noise) of the fp64 oracle.
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    return Tolerance(atol=1e-5, rtol=unit * 1.01)


# Every small case, and the model cases whose fp64 oracle stays cheap (the largest Llama-3-8B
# ones only repeat the same code paths at a size the Python-loop gather would take seconds on).
ORACLE_CASES = [c for c in SPEC.cases if "model" not in c.tags or c.name in (
    "llama3_70b_tp8_decode_b8_ctx4096", "llama3_8b_chunked_prefill", "gpt_oss_120b_tp8_window_sinks_decode",
    "gpt_oss_120b_tp8_sinks_prefill", "gemma2_soft_cap")]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c.name)
def test_reference_matches_dense_attention(case):
    kwargs = case.build(seed=1)
    expected = sdpa_oracle(kwargs) if kwargs["logits_soft_cap"] == 0 and kwargs["sinks"] is None \
        else formula_oracle(kwargs)
    assert_close(reference(**kwargs), expected, _bf16_rounding(kwargs["query"].dtype), case.name)


@given(
    q_kv=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 20)), min_size=0, max_size=4),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (3, 3)]),
    head_dim=st.sampled_from([4, 8, 16]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    causal=st.booleans(),
    window=st.sampled_from([0, 0, 1, 3, 8]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_sdpa_on_drawn_shapes(q_kv, heads, head_dim, block_size, causal, window,
                                                dtype, fp8, seed):
    window = window if causal else 0
    q_lens = tuple(min(q, kv) if causal else (q if kv else 0) for q, kv in q_kv)
    kv_lens = tuple(kv for _, kv in q_kv)
    make = spec_module._maker(q_lens, kv_lens, heads[0], heads[1], head_dim, block_size, dtype,
                              FP8 if fp8 else None, causal, window, scales=(0.25, 0.3) if fp8 else None)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    assert_close(reference(**kwargs), sdpa_oracle(kwargs), _bf16_rounding(dtype), "drawn")
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    assert (fake.shape, fake.dtype) == (kwargs["query"].shape, dtype)


def _small(**options):
    base = dict(q_lens=(2, 1, 5), kv_lens=(9, 4, 5), num_heads=4, num_kv_heads=2, head_dim=16,
                block_size=4)
    base.update(options)
    return spec_module._maker(**base)(torch.device("cpu"), torch.Generator().manual_seed(7))


def test_hand_worked_decode_with_sink():
    # One query, two keys with scores 0 and ln 2 (after scale), values 1 and 4, sink ln 1 = 0:
    # p = (1, 2) / (1 + 1 + 2) -> out = (1 * 1 + 2 * 4) / 4 = 2.25. Without the sink: 9 / 3 = 3.
    k_cache = torch.zeros(3, 2, 1, 1, dtype=torch.bfloat16)
    v_cache = torch.zeros(3, 2, 1, 1, dtype=torch.bfloat16)
    k_cache[2, 0], k_cache[2, 1] = 0.0, 1.0  # block 2 holds both positions
    v_cache[2, 0], v_cache[2, 1] = 1.0, 4.0
    k_cache[0], v_cache[0] = 100.0, 100.0  # a decoy in the unused trailing table entry
    args = dict(query=torch.ones(1, 1, 1, dtype=torch.bfloat16), k_cache=k_cache, v_cache=v_cache,
                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                block_table=torch.tensor([[2, 0]], dtype=torch.int32),
                seq_lens=torch.tensor([2], dtype=torch.int32), max_query_len=1, max_seq_len=2,
                scale=math.log(2))
    assert reference(**args).item() == 3.0
    assert reference(**args, sinks=torch.zeros(1)).item() == 2.25


def test_causal_convention_for_a_chunk():
    # A 2-query chunk at the end of a 5-long sequence: query 0 sits at position 3, query 1 at 4.
    # Values equal to the position (D = 1) and equal scores make each output the mean position.
    k_cache = torch.zeros(2, 4, 1, 1, dtype=torch.float16)
    v_cache = torch.arange(8, dtype=torch.float16).reshape(2, 4, 1, 1)
    args = dict(query=torch.zeros(2, 1, 1, dtype=torch.float16), k_cache=k_cache, v_cache=v_cache,
                cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                seq_lens=torch.tensor([5], dtype=torch.int32), max_query_len=2, max_seq_len=5, scale=1.0)
    assert reference(**args).flatten().tolist() == [1.5, 2.0]  # mean(0..3), mean(0..4)
    assert reference(**args, sliding_window=2).flatten().tolist() == [2.5, 3.5]  # {2,3}, {3,4}
    assert reference(**args, causal=False).flatten().tolist() == [2.0, 2.0]


def test_sinks_limits():
    kwargs = _small(with_sinks=True)
    kwargs["sinks"] = torch.full((4,), -1e4)  # e^-1e4 = 0: the same as no sinks
    no_sink = dict(kwargs, sinks=None)
    assert_close(reference(**kwargs), reference(**no_sink), Tolerance(atol=0, rtol=2**-8), "sink -1e4")
    kwargs["sinks"] = torch.full((4,), 1e4)  # the sink takes all the mass
    assert reference(**kwargs).abs().max().item() == 0.0


def test_huge_soft_cap_is_no_cap():
    kwargs = _small(logits_soft_cap=1e9)
    assert_close(reference(**kwargs), reference(**dict(kwargs, logits_soft_cap=0.0)),
                 Tolerance(atol=0, rtol=0), "cap 1e9")


def test_soft_cap_bites():
    kwargs = _small(logits_soft_cap=2.0, scale=1.0)
    capped, uncapped = reference(**kwargs), reference(**dict(kwargs, logits_soft_cap=0.0))
    assert (capped.float() - uncapped.float()).abs().max() > 0.1
    assert_close(capped, formula_oracle(kwargs), _bf16_rounding(torch.bfloat16), "soft cap")


def test_fp8_cache_equals_dequantized_bf16_cache():
    # Power-of-two scales make code * scale exact in bf16, so the fp32 math sees identical inputs.
    kwargs = _small(cache_dtype=FP8, scales=(0.25, 0.125), sliding_window=3, with_sinks=True)
    dequantized = dict(kwargs, k_scale=None, v_scale=None,
                       k_cache=(kwargs["k_cache"].float() * 0.25).to(torch.bfloat16),
                       v_cache=(kwargs["v_cache"].float() * 0.125).to(torch.bfloat16))
    assert torch.equal(reference(**kwargs), reference(**dequantized))


def test_output_ignores_unread_memory_and_physical_block_placement():
    kwargs = _small(table_slack=4, spare_blocks=6)
    before = reference(**kwargs)
    # Scramble every cache slot no sequence reads (spare blocks, tails of last blocks) and the
    # unused table entries: the output must not move.
    read = torch.zeros(kwargs["k_cache"].shape[:2], dtype=torch.bool)
    table = kwargs["block_table"].clone()
    for b, kv_len in enumerate(kwargs["seq_lens"].tolist()):
        for j in range(kv_len):
            read[table[b, j // 4], j % 4] = True
        table[b, -(-kv_len // 4):] = 10**6  # never read, so any value is allowed
    for name in ("k_cache", "v_cache"):
        kwargs[name][~read] = torch.randn(int((~read).sum()), 2, 16, dtype=torch.bfloat16) * 50
    kwargs["block_table"] = table
    assert torch.equal(reference(**kwargs), before)
    # Relabel physical blocks: permute the cache's blocks and the table's ids together.
    num_blocks = kwargs["k_cache"].shape[0]
    new_of_old = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    moved = dict(kwargs)
    for name in ("k_cache", "v_cache"):
        moved[name] = torch.empty_like(kwargs[name])
        moved[name][new_of_old] = kwargs[name]
    valid = table < num_blocks
    moved["block_table"] = torch.where(valid, new_of_old[table.clamp_max(num_blocks - 1).long()].int(), table)
    assert torch.equal(reference(**moved), before)


# gpu-tagged cases are GB-sized: the reference runs them in the GPU suite (conformance), not here.
@pytest.mark.parametrize("case", [c for c in SPEC.cases if "gpu" not in c.tags], ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    assert (fake.shape, fake.dtype, fake.stride(), fake.device.type) == (real.shape, real.dtype, real.stride(), "meta")
    SPEC.validate(**kwargs)
    SPEC.check_close(real, real.clone(), kwargs)
    assert not real.isnan().any()


def test_cases_cover_the_brief():
    names = {c.name for c in SPEC.cases}
    assert {"empty_batch", "no_queries", "single_token", "partial_blocks", "table_slack_shared_prefix",
            "llama3_8b_prefill_t1024", "llama3_8b_chunked_prefill", "llama3_8b_fp8_decode_b8_ctx4096"} <= names
    for tag in ("model", "random", "edge", "quick"):
        assert SPEC.cases_tagged(tag), tag
    kwargs = SPEC.case("llama3_8b_decode_b8_ctx4096").build()
    assert kwargs["query"].shape == (8, 32, 128) and kwargs["k_cache"].shape[1:] == (16, 8, 128)


def test_cost_counts_visible_pairs_and_kv_rows_once():
    kwargs = SPEC.case("small_sliding_window").build()  # q (6, 1, 12), kv (20, 13, 12), W 5
    pairs = 6 * 5 + 1 * 5 + (1 + 2 + 3 + 4 + 5 * 8)
    rows = (6 + 4) + 5 + 12  # distinct kv positions read per sequence
    cost = SPEC.cost(kwargs)
    assert cost.flops == 4 * 32 * 4 * pairs
    query_bytes = 2 * 19 * 4 * 32 * 2
    metadata = 4 * 4 + 3 * 4 + (5 + 4 + 3) * 4
    assert cost.bytes == query_bytes + 2 * rows * 1 * 32 * 2 + metadata


def _good(**changes):
    kwargs = _small(cache_dtype=FP8, scales=(0.5, 0.5), with_sinks=True)
    kwargs.update(changes)
    return kwargs


_I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"query": torch.zeros(8, 4, 16)}, "query", "dtype in"),
        ({"query": torch.zeros(8, 64, dtype=torch.bfloat16)}, "query", "3-d tensor"),
        ({"query": [[0.0]]}, "query", "torch.Tensor"),
        ({"k_cache": torch.zeros(9, 4, 2, 16, dtype=torch.float16)}, "k_cache", "dtype in"),
        ({"k_cache": torch.zeros(9, 4, 32, dtype=FP8)}, "k_cache", "4-d tensor"),
        ({"k_cache": torch.zeros(9, 4, 2, 8, dtype=FP8)}, "k_cache", "head dim D = 16"),
        ({"k_cache": torch.zeros(9, 4, 3, 16, dtype=FP8)}, "k_cache", "dividing Hq"),
        ({"v_cache": torch.zeros(9, 4, 2, 16, dtype=torch.bfloat16)}, "v_cache", "dtype in"),
        ({"v_cache": torch.zeros(8, 4, 2, 16, dtype=FP8)}, "v_cache", "k_cache's"),
        ({"cu_seqlens_q": torch.tensor([0, 2, 3, 8])}, "cu_seqlens_q", "dtype in"),
        ({"cu_seqlens_q": torch.zeros(0, **_I32)}, "cu_seqlens_q", "B+1"),
        ({"cu_seqlens_q": torch.tensor([0, 3, 8], **_I32)}, "block_table", "2 rows"),
        ({"block_table": torch.zeros(3, 4)}, "block_table", "dtype in"),
        ({"block_table": torch.zeros(12, **_I32)}, "block_table", "2-d tensor"),
        ({"block_table": torch.zeros(2, 4, **_I32)}, "block_table", "3 rows"),
        ({"seq_lens": torch.tensor([9, 4, 5])}, "seq_lens", "dtype in"),
        ({"seq_lens": torch.tensor([9, 4], **_I32)}, "seq_lens", "shape (3,)"),
        ({"max_query_len": 5.0}, "max_query_len", "a Python int"),
        ({"max_query_len": torch.tensor(5)}, "max_query_len", "a Python int"),
        ({"max_seq_len": -1}, "max_seq_len", ">= 0"),
        ({"max_seq_len": True}, "max_seq_len", "a Python int"),
        ({"scale": torch.tensor(0.25)}, "scale", "float"),
        ({"causal": 1}, "causal", "a bool"),
        ({"sliding_window": -1}, "sliding_window", ">= 0"),
        ({"sliding_window": None}, "sliding_window", "a Python int"),
        ({"sliding_window": 4, "causal": False}, "sliding_window", "causal=False"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap", ">= 0"),
        ({"logits_soft_cap": None}, "logits_soft_cap", "a Python float"),
        ({"logits_soft_cap": float("nan")}, "logits_soft_cap", "a finite float >= 0"),
        ({"scale": float("inf")}, "scale", "a finite float"),
        ({"sinks": torch.zeros(2)}, "sinks", "shape (4,)"),
        ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, "sinks", "dtype in"),
        ({"sinks": torch.zeros(4, device="meta")}, "sinks", "on cpu"),
        ({"k_scale": 0.5}, "k_scale", "torch.Tensor"),
        ({"k_scale": torch.ones(2)}, "k_scale", "shape () or (1,)"),
        ({"v_scale": torch.ones((), dtype=torch.float64)}, "v_scale", "fp32"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "paged_attention"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_scales_are_rejected_for_bf16_caches():
    kwargs = _small(scales=None)
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**dict(kwargs, k_scale=torch.ones(())))
    assert info.value.argument == "k_scale"


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())  # T = 8, B = 3, max_query_len = 5, max_seq_len = 9
    # Sizes that change per batch enter as power-of-two classes (T 8 and 14 share one; so do
    # contexts of 9 and 12 tokens): a handful of keys serve every batch.
    assert key == SPEC.validate(**_good(query=torch.randn(14, 4, 16, dtype=torch.bfloat16),
                                        max_seq_len=12))
    assert key.num_tokens_class == 15 and key.num_seqs_class == 3 and key.max_query_len_class == 7
    assert key.max_seq_len_class == 15 and key != SPEC.validate(**_good(max_seq_len=4000))
    assert key != SPEC.validate(**_good(query=torch.randn(16, 4, 16, dtype=torch.bfloat16)))
    assert key != SPEC.validate(**_good(max_query_len=1))  # decode vs prefill is
    assert SPEC.validate(**_good(max_query_len=1)).decode and not key.decode
    assert key != SPEC.validate(**_good(sinks=None))
    assert key != SPEC.validate(**_good(sliding_window=7))
    assert key != SPEC.validate(**_good(logits_soft_cap=30.0))


def test_key_holds_every_tensors_layout():
    """What kernels' address arithmetic depends on is in the key, so a decision cached for one
    layout is never reused for another: a block table read column-major (equal values), a query
    view 4 bytes off its allocation, non-unit-stride sinks and sequence lengths."""
    good = _good()
    key = SPEC.validate(**good)
    assert all(getattr(key, f"{name}_layout").unit_stride
               for name in ("query", "k_cache", "v_cache", "cu_seqlens_q", "block_table", "seq_lens", "sinks"))
    table = good["block_table"]
    column_major = table.t().contiguous().t()
    assert torch.equal(column_major, table)
    assert not SPEC.validate(**_good(block_table=column_major)).block_table_layout.unit_stride
    wide = torch.zeros(8, 4, 18, dtype=torch.bfloat16)
    shifted = SPEC.validate(**_good(query=wide[..., 2:]))
    assert shifted.query_layout.unit_stride and shifted.query_layout.alignment == 4
    assert not shifted.query_layout.dense_rows and key.query_layout.dense_rows
    assert not SPEC.validate(**_good(sinks=torch.randn(8)[::2])).sinks_layout.unit_stride
    assert not SPEC.validate(**_good(seq_lens=good["seq_lens"].repeat_interleave(2)[::2])).seq_lens_layout.unit_stride
    assert SPEC.validate(**_good(sinks=None)).sinks_layout is None
