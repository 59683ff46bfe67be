"""backends/cpu/_paged_gather.py: the chunking rule (the routine itself runs through the entries'
tests, tests/backends/cpu/test_paged_attention.py and test_mla_decode.py)."""

from __future__ import annotations

from unittest import mock

from kernelmux.backends.cpu import _paged_gather


def _budget(chunk_bytes: int):
    return mock.patch.object(_paged_gather, "_CHUNK_BYTES", chunk_bytes)


def test_chunks_group_equal_query_lengths_under_the_budget():
    seqs = [_paged_gather._Sequence(b, 0, q, kv) for b, (q, kv) in
            enumerate([(1, 100), (3, 10), (1, 5), (1, 60), (3, 12), (2, 7)])]
    with _budget(200):  # bytes; row_bytes 1 below: at most 200 padded positions per chunk
        chunks = _paged_gather._chunks(seqs, row_bytes=1)
    assert [[s.index for s in c] for c in chunks] == [[2, 3], [0], [5], [1, 4]]
    # Every sequence exactly once, and one q_len per chunk.
    assert sorted(s.index for c in chunks for s in c) == list(range(6))
    assert all(len({s.q_len for s in c}) == 1 for c in chunks)


def test_a_sequence_larger_than_the_budget_is_a_chunk_of_its_own():
    seqs = [_paged_gather._Sequence(b, b, 1, 1000) for b in range(3)]
    with _budget(10):
        assert [len(c) for c in _paged_gather._chunks(seqs, row_bytes=8)] == [1, 1, 1]
