"""Checked mode's look at device data: rules on the contents of index tensors (offsets, lengths,
block tables, slot and expert ids), evaluated in one device pass with one sync, that raise a
``DeviceDataError`` naming the argument, the rule and the first element that breaks it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kernelmux.errors import DeviceDataError

__all__ = [
    "Rule",
    "distinct_rule",
    "enforce",
    "index_rule",
    "offsets_rules",
    "paged_batch_rules",
    "range_rule",
]


@dataclass(frozen=True)
class Rule:
    """``broken`` is True where ``argument`` breaks the rule ``expected``; ``actual(coords)``
    words the first broken element (its coordinates in ``broken``)."""

    argument: str
    expected: str
    broken: torch.Tensor
    actual: Callable[[tuple[int, ...]], str]


def enforce(op: str, rules: Sequence[Rule]) -> None:
    """Raise DeviceDataError for the first rule broken anywhere; one sync when none is."""
    if not rules:
        return
    flags = torch.stack([rule.broken.any() for rule in rules]).tolist()  # the one sync
    for rule, broken in zip(rules, flags):
        if broken:
            first = tuple(int(i) for i in rule.broken.nonzero()[0].tolist())
            raise DeviceDataError(op, rule.argument, rule.expected, rule.actual(first))


def _at(tensor: torch.Tensor, name: str) -> Callable[[tuple[int, ...]], str]:
    return lambda c: f"{name}[{', '.join(map(str, c))}] = {tensor[c].item()}"


def index_rule(argument: str, indices: torch.Tensor, bound: int, what: str, *,
               negative_skips: bool) -> Rule:
    """Every index of ``indices`` in ``[0, bound)`` (``what`` names the indexed range); with
    ``negative_skips``, negative entries are padding and pass."""
    if not negative_skips:
        return range_rule(argument, indices, 0, bound, what)
    return Rule(argument, f"entries < {bound} ({what}; negative = padding)", indices >= bound,
                _at(indices, argument))


def range_rule(argument: str, values: torch.Tensor, low: int, high: int, what: str) -> Rule:
    """Every entry of ``values`` in ``[low, high)`` (``what`` says what the range holds), for
    indices whose padding or "elsewhere" marker is one particular value (an expert map's -1)."""
    return Rule(argument, f"entries in [{low}, {high}) ({what})", (values < low) | (values >= high),
                _at(values, argument))


def distinct_rule(argument: str, indices: torch.Tensor, what: str, *, negative_skips: bool) -> Rule:
    """The entries of each row of ``indices`` (along its last dim) distinct: ``what`` says what
    a repeat would make collide; with ``negative_skips``, negative entries are padding and may
    repeat. One sort per row."""
    values, order = indices.sort(dim=-1, stable=True)  # stable: a repeat's positions in order
    repeated = values[..., 1:] == values[..., :-1]
    if negative_skips:
        repeated &= values[..., 1:] >= 0
    scope = "in each row" if indices.dim() > 1 else "among them"
    padding = " (negative = padding, may repeat)" if negative_skips else ""

    def actual(c: tuple[int, ...]) -> str:
        *row, i = c
        first, second = (int(order[(*row, j)].item()) for j in (i, i + 1))
        where = ", ".join(map(str, row)) + ", " if row else ""
        return (f"{argument}[{where}{first}] = {argument}[{where}{second}] = "
                f"{values[(*row, i)].item()}")

    return Rule(argument, f"distinct entries {scope}{padding} ({what})", repeated, actual)


def offsets_rules(argument: str, offsets: torch.Tensor, total: int, total_name: str) -> list[Rule]:
    """``offsets`` ``[B+1]`` start at 0, never decrease and end at ``total``."""
    starts_at_zero = Rule(argument, f"{argument}[0] = 0", offsets[:1] != 0, _at(offsets, argument))
    steps = offsets[1:] - offsets[:-1]
    nondecreasing = Rule(
        argument, "nondecreasing offsets", steps < 0,
        lambda c: f"{argument}[{c[0] + 1}] = {offsets[c[0] + 1].item()} < {argument}[{c[0]}] = "
                  f"{offsets[c[0]].item()}",
    )
    last = offsets.shape[0] - 1
    ends_at_total = Rule(
        argument, f"{argument}[-1] = {total_name} = {total}", offsets[-1:] != total,
        lambda c: f"{argument}[{last}] = {offsets[last].item()}",
    )
    return [starts_at_zero, nondecreasing, ends_at_total]


def paged_batch_rules(cu_seqlens_q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      num_tokens: int, max_query_len: int, max_seq_len: int, block_size: int,
                      num_blocks: int, causal: bool) -> list[Rule]:
    """vLLM's paged batch description against the query rows and the cache it indexes: the
    offsets, each sequence's query count and length within the host bounds, enough block-table
    columns, and every block a sequence reads inside the cache."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    rules = offsets_rules("cu_seqlens_q", cu_seqlens_q, num_tokens, "T (query rows)")
    rules.append(Rule(
        "cu_seqlens_q", f"at most max_query_len = {max_query_len} queries per sequence",
        q_lens > max_query_len,
        lambda c: f"{q_lens[c].item()} queries in sequence {c[0]} (cu_seqlens_q[{c[0] + 1}] - "
                  f"cu_seqlens_q[{c[0]}])",
    ))
    rules.append(Rule("seq_lens", f"lengths in [0, max_seq_len = {max_seq_len}]",
                      (seq_lens < 0) | (seq_lens > max_seq_len), _at(seq_lens, "seq_lens")))
    if causal:
        rules.append(Rule(
            "seq_lens", "seq_lens[b] >= the sequence's query count (causal: its new queries are "
            "the last positions of the sequence)", seq_lens < q_lens,
            lambda c: f"seq_lens[{c[0]}] = {seq_lens[c].item()} with {q_lens[c].item()} queries",
        ))
    needed = (seq_lens.clamp_min(0).long() + block_size - 1) // block_size
    columns = block_table.shape[1]
    rules.append(Rule(
        "block_table", f"{columns} columns, enough for ceil(seq_lens[b] / {block_size}) blocks",
        needed > columns,
        lambda c: f"sequence {c[0]} of length {seq_lens[c].item()} needs {needed[c].item()} blocks",
    ))
    read = torch.arange(columns, device=block_table.device)[None, :] < needed[:, None]
    rules.append(Rule(
        "block_table", f"block ids in [0, num_blocks = {num_blocks}) in the entries a sequence reads",
        read & ((block_table < 0) | (block_table >= num_blocks)), _at(block_table, "block_table"),
    ))
    return rules
