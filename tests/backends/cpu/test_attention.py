"""The cpu backend's paged_attention and mla_decode against the references on drawn shapes, with
the chunk budget shrunk so batches split into many chunks; the exact fp8 route code by code; and
the chunking rule. The named cases run in tests/backends/test_conformance.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelmux
from kernelmux.backends.cpu import _fp8, attention
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as pa_spec

FP8 = torch.float8_e4m3fn
ALL_CODES = torch.arange(256, dtype=torch.uint8).view(FP8)


def _budget(chunk_bytes: int):
    return mock.patch.object(attention, "_CHUNK_BYTES", chunk_bytes)


def _compare(spec, fn, kwargs) -> None:
    expected = spec.reference(**kwargs)
    spec.check_close(fn(**kwargs), expected, kwargs)


# ------------------------------------------------------------------ the exact fp8 route


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_route_is_exact_for_every_code(dtype):
    codes = ALL_CODES.view(16, 16)  # 2-D: the route keeps the shape
    out = torch.full((256,), 7.0, dtype=dtype)
    got = _fp8.fp8_to_half_scaled(codes, out, torch.empty(256, dtype=torch.int16))
    assert got.shape == codes.shape and got.dtype == dtype
    want = codes.float() / _fp8.FP8_ROUTE_SCALE  # torch's own conversion, exact in fp32
    nan = want.isnan()
    assert nan.sum() == 2  # 0x7f and 0xff
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.float()[~nan], want[~nan])
    # Signed zeros survive too (0x80 is -0.0).
    assert torch.signbit(got.view(-1)[0x80]) and not torch.signbit(got.view(-1)[0x00])


def test_fp8_route_restores_nan_only_when_present():
    codes = torch.tensor([0x38, 0xB8, 0x7E, 0xFE], dtype=torch.uint8).view(FP8)  # 1, -1, 448, -448
    bits = torch.empty(4, dtype=torch.int16)
    out = _fp8.fp8_to_half_scaled(codes, torch.empty(4, dtype=torch.bfloat16), bits)
    assert out.float().mul(_fp8.FP8_ROUTE_SCALE).tolist() == [1.0, -1.0, 448.0, -448.0]
    empty = _fp8.fp8_to_half_scaled(codes[:0], torch.empty(0, dtype=torch.float16), bits[:0])
    assert empty.shape == (0,)


def test_nan_in_a_read_fp8_slot_propagates_like_the_reference():
    kwargs = pa_spec.SPEC.case("small_fp8").build("cpu", 3)
    table, block_size = kwargs["block_table"], kwargs["k_cache"].shape[1]
    block, offset = int(table[1, 0]), 2  # sequence 1 (length 6) reads position 2
    kwargs["k_cache"].view(torch.uint8)[block, offset, 0, 0] = 0x7F
    expected = pa_spec.SPEC.reference(**kwargs)
    got = attention.paged_attention(**kwargs)
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    assert block_size > offset


# ------------------------------------------------------------------ chunking


def test_chunks_group_equal_query_lengths_under_the_budget():
    seqs = [attention._Sequence(b, 0, q, kv) for b, (q, kv) in
            enumerate([(1, 100), (3, 10), (1, 5), (1, 60), (3, 12), (2, 7)])]
    with _budget(200):  # bytes; row_bytes 1 below: at most 200 padded positions per chunk
        chunks = attention._chunks(seqs, row_bytes=1)
    assert [[s.index for s in c] for c in chunks] == [[2, 3], [0], [5], [1, 4]]
    # Every sequence exactly once, and one q_len per chunk.
    assert sorted(s.index for c in chunks for s in c) == list(range(6))
    assert all(len({s.q_len for s in c}) == 1 for c in chunks)


def test_a_sequence_larger_than_the_budget_is_a_chunk_of_its_own():
    seqs = [attention._Sequence(b, b, 1, 1000) for b in range(3)]
    with _budget(10):
        assert [len(c) for c in attention._chunks(seqs, row_bytes=8)] == [1, 1, 1]


# ------------------------------------------------------------------ drawn shapes


@settings(deadline=None, max_examples=60)
@given(
    q_kv=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=0, max_size=5),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (8, 1)]),
    head_dim=st.sampled_from([8, 16, 64]),
    block_size=st.sampled_from([1, 4, 16]),
    causal=st.booleans(),
    window=st.sampled_from([0, 0, 1, 5]),
    soft_cap=st.sampled_from([0.0, 0.0, 2.0]),
    sinks=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    chunk_bytes=st.sampled_from([1, 4096, attention._CHUNK_BYTES]),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_attention_matches_reference_on_drawn_shapes(
    q_kv, heads, head_dim, block_size, causal, window, soft_cap, sinks, dtype, fp8, chunk_bytes, seed
):
    q_lens = tuple(min(q, kv) if causal else q for q, kv in q_kv)
    kv_lens = tuple(kv for _, kv in q_kv)
    make = pa_spec._maker(
        q_lens, kv_lens, heads[0], heads[1], head_dim, block_size, dtype, FP8 if fp8 else None,
        causal, window if causal else 0, soft_cap, sinks, scales=(0.3, 0.7) if fp8 else None,
        scale=0.05 if fp8 else None,
    )
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    with _budget(chunk_bytes):
        _compare(pa_spec.SPEC, attention.paged_attention, kwargs)


@settings(deadline=None, max_examples=40)
@given(
    q_kv=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40)), min_size=0, max_size=5),
    heads=st.integers(1, 9),
    dims=st.sampled_from([(8, 8), (24, 16), (40, 32)]),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    return_lse=st.booleans(),
    nan_in_unused=st.booleans(),
    chunk_bytes=st.sampled_from([1, 4096, attention._CHUNK_BYTES]),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_decode_matches_reference_on_drawn_shapes(
    q_kv, heads, dims, block_size, dtype, fp8, return_lse, nan_in_unused, chunk_bytes, seed
):
    q_lens = tuple(min(q, kv) for q, kv in q_kv)
    kv_lens = tuple(kv for _, kv in q_kv)
    make = mla_spec._maker(
        q_lens, kv_lens, heads, dims[0], dims[1], block_size, dtype, FP8 if fp8 else None,
        kv_scale=0.3 if fp8 else None, scale=0.1 if fp8 else None, return_lse=return_lse,
        nan_in_unused=nan_in_unused,
    )
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    with _budget(chunk_bytes):
        _compare(mla_spec.SPEC, attention.mla_decode, kwargs)


@pytest.mark.parametrize(
    "case", ["small_mixed_batch", "table_slack_shared_prefix", "small_soft_cap_sinks_window"]
)
def test_every_chunk_split_of_a_mixed_batch(case):
    kwargs = pa_spec.SPEC.case(case).build("cpu", 11)
    expected = pa_spec.SPEC.reference(**kwargs)
    for budget in (1, 2048, 8192, 1 << 30):
        with _budget(budget):
            pa_spec.SPEC.check_close(attention.paged_attention(**kwargs), expected, kwargs)


def test_kv_len_zero_without_causal_gives_zeros_like_the_reference():
    make = pa_spec._maker((2, 3), (0, 5), 2, 1, 8, 4, causal=False)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    expected = pa_spec.SPEC.reference(**kwargs)
    got = attention.paged_attention(**kwargs)
    assert torch.equal(got[:2], torch.zeros_like(got[:2]))
    pa_spec.SPEC.check_close(got, expected, kwargs)


def test_dispatch_chooses_cpu_for_cpu_tensors():
    engine = kernelmux.configure(from_env=False)
    try:
        for op, spec in (("paged_attention", pa_spec.SPEC), ("mla_decode", mla_spec.SPEC)):
            kwargs = spec.case("small_fp8").build("cpu", 0)
            assert engine.resolve(op, **kwargs) is getattr(attention, op)
    finally:
        kernelmux.reset()
