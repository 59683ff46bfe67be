"""The cpu backend's paged_attention against the reference on drawn shapes, with the chunk budget
shrunk so batches split into many chunks, and on the edge cases of the gather. The named cases
run in tests/backends/test_conformance.py."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelmux
from kernelmux.backends.cpu import _paged_gather
from kernelmux.backends.cpu.paged_attention import paged_attention
from kernelmux.specs import paged_attention as pa_spec

FP8 = torch.float8_e4m3fn


@contextlib.contextmanager
def _budget(chunk_bytes: int):
    """Chunks of at most ``chunk_bytes`` of gathered KV, on the soft cap's path too."""
    with mock.patch.object(_paged_gather, "_CHUNK_BYTES", chunk_bytes), \
            mock.patch.object(_paged_gather, "_SOFT_CAP_CHUNK_BYTES", chunk_bytes):
        yield


def test_nan_in_a_read_fp8_slot_propagates_like_the_reference():
    kwargs = pa_spec.SPEC.case("small_fp8").build("cpu", 3)
    table, block_size = kwargs["block_table"], kwargs["k_cache"].shape[1]
    block, offset = int(table[1, 0]), 2  # sequence 1 (length 6) reads position 2
    kwargs["k_cache"].view(torch.uint8)[block, offset, 0, 0] = 0x7F
    expected = pa_spec.SPEC.reference(**kwargs)
    got = paged_attention(**kwargs)
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    assert block_size > offset


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
    chunk_bytes=st.sampled_from([1, 4096, _paged_gather._CHUNK_BYTES]),
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
    expected = pa_spec.SPEC.reference(**kwargs)
    with _budget(chunk_bytes):
        pa_spec.SPEC.check_close(paged_attention(**kwargs), expected, kwargs)


def test_a_soft_cap_takes_one_sequence_a_chunk(monkeypatch):
    # Its fp32 path would pad each sequence to the chunk's longest: one a chunk was 2x faster (_SOFT_CAP_CHUNK_BYTES).
    kwargs = pa_spec.SPEC.case("gemma2_soft_cap").build("cpu", 0)
    sizes, attend = [], _paged_gather._attend
    monkeypatch.setattr(_paged_gather, "_attend", lambda q, *args: sizes.append(q.shape[0]) or attend(q, *args))
    pa_spec.SPEC.check_close(paged_attention(**kwargs), pa_spec.SPEC.reference(**kwargs), kwargs)
    assert sizes == [1, 1, 1]  # three sequences


@pytest.mark.parametrize(
    "case", ["small_mixed_batch", "table_slack_shared_prefix", "small_soft_cap_sinks_window"]
)
def test_every_chunk_split_of_a_mixed_batch(case):
    kwargs = pa_spec.SPEC.case(case).build("cpu", 11)
    expected = pa_spec.SPEC.reference(**kwargs)
    for budget in (1, 2048, 8192, 1 << 30):
        with _budget(budget):
            pa_spec.SPEC.check_close(paged_attention(**kwargs), expected, kwargs)


def test_kv_len_zero_without_causal_gives_zeros_like_the_reference():
    make = pa_spec._maker((2, 3), (0, 5), 2, 1, 8, 4, causal=False)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    expected = pa_spec.SPEC.reference(**kwargs)
    got = paged_attention(**kwargs)
    assert torch.equal(got[:2], torch.zeros_like(got[:2]))
    pa_spec.SPEC.check_close(got, expected, kwargs)


def test_dispatch_chooses_cpu_for_cpu_tensors():
    engine = kernelmux.configure(from_env=False)
    try:
        kwargs = pa_spec.SPEC.case("small_fp8").build("cpu", 0)
        assert engine.resolve("paged_attention", **kwargs) is paged_attention
    finally:
        kernelmux.reset()
