"""Argument checks shared by every spec's validate(): cheap, and each failure names the argument."""

from __future__ import annotations

from typing import Any, Collection

import torch

from kernelmux.errors import InvalidArgumentError

__all__ = ["check_choice", "check_int", "check_tensor", "dtype_names"]


def dtype_names(dtypes: Collection[torch.dtype]) -> str:
    return "{" + ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) + "}"


def check_tensor(
    op: str,
    name: str,
    value: Any,
    *,
    dtypes: Collection[torch.dtype],
    rank: int,
    device: torch.device | None = None,
) -> None:
    """``value`` is a tensor of one of ``dtypes`` with ``rank`` dims (on ``device`` if given)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(op, name, "a torch.Tensor", type(value).__name__)
    if value.dtype not in dtypes:
        raise InvalidArgumentError(op, name, f"dtype in {dtype_names(dtypes)}", value.dtype)
    if value.dim() != rank:
        raise InvalidArgumentError(
            op, name, f"a {rank}-d tensor", f"{value.dim()}-d tensor of shape {tuple(value.shape)}"
        )
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
    if value not in choices:
        raise InvalidArgumentError(op, name, f"one of {sorted(choices)}", repr(value))
