"""What the flashinfer backend's attention adapters share (backends/flashinfer/_paged.py): the block
table as CSR page lists against a construction written here with python loops, the refusal to plan
inside a CUDA graph capture, and the workspaces and wrappers made once per (device, purpose)."""

from __future__ import annotations

import pytest
import torch

from kernelmux.backends.flashinfer import _paged


def _loops(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """The page lists by hand: each row's first ceil(L / block_size) ids, one row after another."""
    indptr, indices, last = [0], [], []
    for row, length in zip(block_table.tolist(), seq_lens.tolist()):
        pages = -(-length // block_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(length - (pages - 1) * block_size if pages else 0)
    return indptr, indices, last


@pytest.mark.parametrize("seq_lens, block_size, max_blocks", [
    ([17, 31, 15, 16], 16, 2),   # partial last pages, one exactly full
    ([0, 5, 0, 9], 4, 5),        # empty sequences between others; table slack
    ([1], 16, 1),                # one position
    ([40, 36, 48], 8, 15),       # slack of 9+ entries a row
    ([5, 3], 1, 7),              # block size 1
    ([], 16, 4),                 # B = 0
    ([0, 0], 16, 0),             # no block-table columns at all
])
def test_page_lists_match_loops(seq_lens, block_size, max_blocks):
    generator = torch.Generator().manual_seed(len(seq_lens) + max_blocks)
    table = torch.randint(0, 1000, (len(seq_lens), max_blocks), generator=generator, dtype=torch.int32)
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    pages = _paged.page_lists(table, lengths, block_size)
    indptr, indices, last = _loops(table, lengths, block_size)
    assert [t.dtype for t in pages] == [torch.int32] * 3
    assert pages.indptr.tolist() == indptr
    assert pages.last_page_len.tolist() == last
    assert pages.indices.shape == (len(seq_lens) * max_blocks,)
    assert pages.indices[: indptr[-1]].tolist() == indices


def test_page_lists_on_random_tables():
    generator = torch.Generator().manual_seed(7)
    for _ in range(50):
        batch = int(torch.randint(0, 9, (), generator=generator))
        block_size = int(torch.randint(1, 20, (), generator=generator))
        lengths = torch.randint(0, 200, (batch,), generator=generator, dtype=torch.int32)
        max_blocks = int(-(-lengths.max() // block_size)) + 3 if batch else 3
        table = torch.randperm(batch * max_blocks + 5, generator=generator)[: batch * max_blocks]
        table = table.view(batch, max_blocks).to(torch.int32)
        pages = _paged.page_lists(table, lengths, block_size)
        indptr, indices, last = _loops(table, lengths, block_size)
        assert pages.indptr.tolist() == indptr and pages.last_page_len.tolist() == last
        assert pages.indices[: indptr[-1]].tolist() == indices


def test_page_lists_take_a_strided_table_and_int64_lengths():
    # A column slice of a wider table and int64 lengths: the function reads values, not layouts.
    wide = torch.arange(40, dtype=torch.int32).view(4, 10)
    pages = _paged.page_lists(wide[:, ::2], torch.tensor([9, 0, 1, 20]), 4)
    assert pages.indptr.tolist() == [0, 3, 3, 4, 9]
    assert pages.indices[:9].tolist() == [0, 2, 4, 20, 30, 32, 34, 36, 38]
    assert pages.last_page_len.tolist() == [1, 0, 1, 4]


def test_refuse_capture_says_why_and_how_to_avoid_it(monkeypatch):
    _paged.refuse_capture("flashinfer's paged prefill")  # not capturing: nothing happens
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _paged.refuse_capture("flashinfer's paged prefill")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError) as raised:
        _paged.refuse_capture("flashinfer's paged prefill")
    message = str(raised.value)
    assert message.startswith(f"flashinfer's paged prefill: {_paged.HOST_PLAN}")
    assert "which a CUDA graph cannot hold" in message
    assert "KERNELMUX_PREFER" in message and "run this batch eagerly" in message


def test_refuse_capture_never_asks_a_machine_without_cuda(monkeypatch):
    def capturing():
        raise AssertionError("asked about capture without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    _paged.refuse_capture("anything")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_paged, "_workspaces", {})
    monkeypatch.setattr(_paged, "_wrappers", {})


def test_a_workspace_is_made_once_per_device_and_purpose(fresh):
    cpu = torch.device("cpu")
    decode = _paged.workspace(cpu, "decode")
    assert decode.dtype == torch.uint8 and decode.shape == (_paged.WORKSPACE_BYTES,) and decode.device == cpu
    assert _paged.WORKSPACE_BYTES == 128 << 20
    assert not decode[: 8 << 20].any()  # xqa's semaphores start zeroed
    assert _paged.workspace(cpu, "decode") is decode
    prefill = _paged.workspace(cpu, "prefill")
    assert prefill is not decode and prefill.data_ptr() != decode.data_ptr()


def test_a_wrapper_is_made_once_per_device_and_purpose_on_its_own_workspace(fresh):
    cpu = torch.device("cpu")
    made = []

    def make(buffer):
        made.append(buffer)
        return object()

    first = _paged.wrapper(cpu, "prefill", make)
    assert _paged.wrapper(cpu, "prefill", make) is first
    assert len(made) == 1 and made[0] is _paged.workspace(cpu, "prefill")
    other = _paged.wrapper(cpu, "mla", make)
    assert other is not first and len(made) == 2 and made[1] is _paged.workspace(cpu, "mla")


def test_a_failed_make_leaves_nothing_cached(fresh):
    cpu = torch.device("cpu")

    def broken(buffer):
        raise RuntimeError("no kernel for this device")

    with pytest.raises(RuntimeError, match="no kernel"):
        _paged.wrapper(cpu, "prefill", broken)
    made = _paged.wrapper(cpu, "prefill", lambda buffer: ("wrapper", buffer))
    assert made[0] == "wrapper"
