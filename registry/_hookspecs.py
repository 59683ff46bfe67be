"""The pluggy hook specification every kernelmux backend plugin implements."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pluggy

if TYPE_CHECKING:
    from kernelmux.registry._implementation import Implementation

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "kernelmux"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kernelmux_implementations() -> Sequence["Implementation"]:
    """Return the implementations this plugin contributes.

    Called once per process at engine startup. Return records only: do not import heavy
    platform packages (triton, flashinfer, aiter) here; import them inside the implementation or
    let the record's ``packages`` gate it. Requirements a platform must meet go in the record
    (``requirement``, ``packages``, ``devices``) so ``kernelmux explain`` can say why it was not
    chosen on another machine.
    """
