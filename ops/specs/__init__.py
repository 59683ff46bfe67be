"""One module per op spec; ALL_SPECS lists them in a stable order (the single source of op names)."""

from kernelmux.ops.specs import grouped_topk

__all__ = ["ALL_SPECS"]

ALL_SPECS = (grouped_topk.SPEC,)
