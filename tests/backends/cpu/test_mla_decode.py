"""The cpu backend's mla_decode against the reference on drawn shapes, with the chunk budget shrunk
so batches split into many chunks. The named cases run in tests/backends/test_conformance.py."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelmux
from kernelmux.backends.cpu import _paged_gather
from kernelmux.backends.cpu.mla_decode import mla_decode
from kernelmux.specs import mla_decode as mla_spec

FP8 = torch.float8_e4m3fn


def _budget(chunk_bytes: int):
    return mock.patch.object(_paged_gather, "_CHUNK_BYTES", chunk_bytes)


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
    chunk_bytes=st.sampled_from([1, 4096, _paged_gather._CHUNK_BYTES]),
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
    expected = mla_spec.SPEC.reference(**kwargs)
    with _budget(chunk_bytes):
        mla_spec.SPEC.check_close(mla_decode(**kwargs), expected, kwargs)


def test_dispatch_chooses_cpu_for_cpu_tensors():
    engine = kernelmux.configure(from_env=False)
    try:
        kwargs = mla_spec.SPEC.case("small_fp8").build("cpu", 0)
        assert engine.resolve("mla_decode", **kwargs) is mla_decode
    finally:
        kernelmux.reset()
