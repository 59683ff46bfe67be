"""What FlashInfer's paged-attention entry points need besides the tensors: kernelmux's block table
and sequence lengths as the CSR page lists its wrappers plan from (computed on the device, no
sync), the zeroed workspaces they run in (one per device and purpose), and the planned wrappers."""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["HOST_PLAN", "PageLists", "page_lists", "refuse_capture", "workspace", "wrapper"]

# FlashInfer's examples and vLLM size the float workspace of its wrappers at 128 MiB; xqa keeps its
# 8 MiB of semaphores at the front of its own buffer, which must start zeroed and stay its own.
WORKSPACE_BYTES = 128 << 20

_lock = threading.Lock()
_workspaces: dict[tuple[torch.device, str], torch.Tensor] = {}
_wrappers: dict[tuple[torch.device, str], Any] = {}


class PageLists(NamedTuple):
    """A paged KV cache's pages per sequence in FlashInfer's CSR form: sequence ``b`` reads pages
    ``indices[indptr[b]:indptr[b+1]]``, the last one holding ``last_page_len[b]`` positions."""

    indptr: torch.Tensor  # [B+1] int32
    indices: torch.Tensor  # [B * max_blocks] int32: the first indptr[B] are used, the rest is slack
    last_page_len: torch.Tensor  # [B] int32


def page_lists(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PageLists:
    """``block_table [B, max_blocks]`` and ``seq_lens [B]`` as CSR page lists, with device ops only
    (no sync, so the conversion could run inside a CUDA graph): each row's first ``ceil(L_b /
    block_size)`` ids packed one after another, the table's unused tail dropped."""
    num_seqs, max_blocks = block_table.shape
    lengths = seq_lens.to(torch.int64)
    pages = (lengths + block_size - 1) // block_size
    indptr = torch.zeros(num_seqs + 1, dtype=torch.int64, device=block_table.device)
    torch.cumsum(pages, dim=0, out=indptr[1:])
    column = torch.arange(max_blocks, device=block_table.device)
    used = column[None, :] < pages[:, None]
    # Used ids go to their packed place; unused ones to one slack slot past every packed place.
    target = torch.where(used, indptr[:-1, None] + column[None, :], num_seqs * max_blocks)
    indices = torch.zeros(num_seqs * max_blocks + 1, dtype=torch.int32, device=block_table.device)
    indices.scatter_(0, target.flatten(), block_table.to(torch.int32).flatten())
    last_page_len = torch.where(pages > 0, lengths - (pages - 1) * block_size, 0)
    return PageLists(indptr.to(torch.int32), indices[:-1], last_page_len.to(torch.int32))


def workspace(device: torch.device, purpose: str) -> torch.Tensor:
    """A zeroed ``WORKSPACE_BYTES`` uint8 buffer for ``purpose`` on ``device``, made once. Calls on
    one device share it, so they must run in order on one stream, as an engine's layers do."""
    key = (device, purpose)
    with _lock:
        if key not in _workspaces:
            _workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return _workspaces[key]


def wrapper(device: torch.device, purpose: str, make: Callable[[torch.Tensor], Any]) -> Any:
    """The FlashInfer wrapper for ``purpose`` on ``device``, ``make(workspace)`` at the first call."""
    key = (device, purpose)
    with _lock:
        found = _wrappers.get(key)
    if found is None:
        found = make(workspace(device, purpose))
        with _lock:
            found = _wrappers.setdefault(key, found)
    return found


# Why FlashInfer's planned wrappers cannot run inside a CUDA graph (their capture_check's answer).
HOST_PLAN = ("FlashInfer's wrapper plans on the host at every call (it copies the batch description to the CPU), "
             "which a CUDA graph cannot hold")


def refuse_capture(what: str) -> None:
    """Raise when the current stream is capturing a CUDA graph (HOST_PLAN). The engine runs another
    implementation under capture (``capture_check``); this stops a function resolved outside one."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: {HOST_PLAN}; capture with another backend preferred for this op "
                           "(KERNELMUX_PREFER) or run this batch eagerly")
