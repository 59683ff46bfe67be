"""backends/cpu/_paged_gather.py: the chunking rule (the routine itself runs through the entries'
tests, tests/backends/cpu/test_paged_attention.py and test_mla_decode.py)."""

from __future__ import annotations

from kernelmux.backends.cpu import _paged_gather


def test_chunks_group_equal_query_lengths_under_the_budget():
    seqs = [_paged_gather._Sequence(b, 0, q, kv) for b, (q, kv) in
            enumerate([(1, 100), (3, 10), (1, 5), (1, 60), (3, 12), (2, 7)])]
    chunks = _paged_gather._chunks(seqs, row_bytes=1, budget=200)  # at most 200 padded positions per chunk
    assert [[s.index for s in c] for c in chunks] == [[2, 3], [0], [5], [1, 4]]
    # Every sequence exactly once, and one q_len per chunk.
    assert sorted(s.index for c in chunks for s in c) == list(range(6))
    assert all(len({s.q_len for s in c}) == 1 for c in chunks)


def test_a_sequence_larger_than_the_budget_is_a_chunk_of_its_own():
    seqs = [_paged_gather._Sequence(b, b, 1, 1000) for b in range(3)]
    assert [len(c) for c in _paged_gather._chunks(seqs, row_bytes=8, budget=10)] == [1, 1, 1]


def test_a_budget_of_zero_makes_every_sequence_a_chunk():  # the soft cap's _SOFT_CAP_CHUNK_BYTES
    seqs = [_paged_gather._Sequence(b, b, 1, kv) for b, kv in enumerate((5, 3, 9))]
    assert [[s.index for s in c] for c in _paged_gather._chunks(seqs, row_bytes=8, budget=0)] == [[1], [0], [2]]
