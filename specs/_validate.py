"""Argument checks shared by every spec's validate(): cheap, and each failure names the argument."""

from __future__ import annotations

import math
from typing import Any, Collection

import torch

from kernelmux.errors import InvalidArgumentError

__all__ = ["check_choice", "check_float", "check_int", "check_paged_batch", "check_tensor", "dtype_names"]


def dtype_names(dtypes: Collection[torch.dtype]) -> str:
    return "{" + ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) + "}"


def check_tensor(
    op: str,
    name: str,
    value: Any,
    *,
    dtypes: Collection[torch.dtype],
    rank: int | None = None,
    device: torch.device | None = None,
    shape: tuple[int, ...] | None = None,
    meaning: str = "",
) -> None:
    """``value`` is a tensor of one of ``dtypes`` with ``rank`` dims, or of exactly ``shape``
    (``meaning`` says where that shape comes from), on ``device`` if given."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(op, name, "a torch.Tensor", type(value).__name__)
    if value.dtype not in dtypes:
        raise InvalidArgumentError(op, name, f"dtype in {dtype_names(dtypes)}", value.dtype)
    rank = len(shape) if shape is not None else rank
    if value.dim() != rank:
        raise InvalidArgumentError(
            op, name, f"a {rank}-d tensor", f"{value.dim()}-d tensor of shape {tuple(value.shape)}"
        )
    if shape is not None and tuple(value.shape) != shape:
        expected = f"shape {shape} ({meaning})" if meaning else f"shape {shape}"
        raise InvalidArgumentError(op, name, expected, f"shape {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise InvalidArgumentError(
            op, name, f"a tensor on {device} (the device of the first input)", value.device
        )


def check_int(op: str, name: str, value: Any, *, low: int, high: int | None = None) -> None:
    """``value`` is a Python int (not bool) in ``[low, high]``."""
    if type(value) is not int:  # bool is an int subclass and a tensor is not a host int
        raise InvalidArgumentError(op, name, "a Python int", type(value).__name__)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidArgumentError(op, name, f"an int in {bound}", value)


def check_choice(op: str, name: str, value: Any, choices: Collection[Any]) -> None:
    """``value`` is one of ``choices`` (hashable constants: names, dtypes; a dict's keys). Any other
    value, of any type, is an InvalidArgumentError naming the argument, the allowed values and
    the value given."""
    try:
        # Hashed first, so == runs only against a choice of equal hash: an array's elementwise ==
        # never meets a name.
        allowed = value in frozenset(choices)
    except TypeError:  # unhashable (a list, dict, set, array): none of the hashable choices
        allowed = False
    if not allowed:
        kinds = {type(choice) for choice in choices}
        hint = ("" if type(value) in kinds
                else f"a {type(value).__name__} was given; pass one of the values listed")
        raise InvalidArgumentError(op, name, f"one of {sorted(choices, key=repr)}",
                                   _short_repr(value), hint=hint)


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters (a tensor's repr spans lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_paged_batch(
    op: str,
    cu_seqlens_q: Any,
    block_table: Any,
    seq_lens: Any,
    max_query_len: Any,
    max_seq_len: Any,
    scale: Any,
    device: torch.device,
) -> int:
    """The batch description shared by the paged attention ops (vLLM's metadata): int32
    ``cu_seqlens_q [B+1]``, ``block_table [B, max_blocks]``, ``seq_lens [B]`` on ``device``, host
    ints ``max_query_len`` and ``max_seq_len``, a float ``scale``. Returns B."""
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), rank=1, device=device)
    if cu_seqlens_q.shape[0] < 1:
        raise InvalidArgumentError(op, "cu_seqlens_q", "shape (B+1,) with B >= 0", (0,))
    batch = cu_seqlens_q.shape[0] - 1
    check_tensor(op, "block_table", block_table, dtypes=(torch.int32,), rank=2, device=device)
    if block_table.shape[0] != batch:
        raise InvalidArgumentError(
            op, "block_table", f"{batch} rows (B = len(cu_seqlens_q) - 1)", tuple(block_table.shape)
        )
    check_tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), rank=1, device=device)
    if seq_lens.shape[0] != batch:
        raise InvalidArgumentError(
            op, "seq_lens", f"shape ({batch},) (B = len(cu_seqlens_q) - 1)", tuple(seq_lens.shape)
        )
    check_int(op, "max_query_len", max_query_len, low=0)
    check_int(op, "max_seq_len", max_seq_len, low=0)
    check_float(op, "scale", scale)
    return batch


def check_float(op: str, name: str, value: Any, *, low: float | None = None) -> None:
    """``value`` is a finite Python float (or int), at least ``low`` if given. Host floats go
    into dispatch keys by value: a NaN key would never match itself."""
    if type(value) not in (float, int):
        raise InvalidArgumentError(op, name, "a Python float", type(value).__name__)
    if not math.isfinite(value) or (low is not None and value < low):
        bound = f" >= {low:g}" if low is not None else ""
        raise InvalidArgumentError(op, name, f"a finite float{bound}", repr(value))
