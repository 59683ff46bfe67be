"""Fake vllm-xpu-kernels: how the fake extension modules register their torch ops at import, as the .so
files do: the shipped schema string and a CPU kernel written here, so the dispatcher itself enforces
argument names, order and types; defined afresh at every import of the fake, and removable."""

from __future__ import annotations

import sys
import types
from typing import Callable

import torch

__all__ = ["REVERSED", "define", "unload"]

# A torch op can be defined once per process, while tests install the fake afresh (install_fake drops
# every vllm_xpu_kernels module from sys.modules; a modified fake may change a schema): the libraries
# live in a holder module outside the package, and a definition replaces an earlier import's.
# unload() removes them all (test teardown). The ops named in REVERSED (a test sets it in an installed
# copy) get their schema's arguments in reverse order, as a release that reorders them would.

REVERSED: frozenset = frozenset()
_HOLDER = "_fake_vllm_xpu_kernels_libraries"  # not under vllm_xpu_kernels: survives install_fake


def _libraries() -> dict[tuple[str, str], torch.library.Library]:
    holder = sys.modules.get(_HOLDER)
    if holder is None:
        holder = sys.modules[_HOLDER] = types.ModuleType(_HOLDER)
        holder.libraries = {}
    return holder.libraries


def _reversed(schema: str, kernel: Callable) -> tuple[str, Callable]:
    """``schema`` with its arguments in reverse order, and ``kernel`` taking them so."""
    head, rest = schema.split("(", 1)
    depth, end = 1, 0
    while depth:  # the argument list's closing parenthesis (Tensor(a!) nests one)
        depth += {"(": 1, ")": -1}.get(rest[end], 0)
        end += 1
    arguments = [a.strip() for a in rest[:end - 1].split(",")]
    return f"{head}({', '.join(arguments[::-1])}{rest[end - 1:]}", lambda *args: kernel(*args[::-1])


def define(namespace: str, schema: str, kernel: Callable) -> None:
    """``namespace::schema`` with ``kernel`` as its CPU implementation (the real ones register XPU)."""
    name = schema.split("(", 1)[0].strip()
    if name in REVERSED:
        schema, kernel = _reversed(schema, kernel)
    libraries = _libraries()
    old = libraries.pop((namespace, name), None)
    if old is not None:
        old._destroy()
    # FRAGMENT: other fakes or libraries may define ops in the same namespace (vLLM's _C).
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(schema)
    library.impl(name, kernel, "CPU")
    libraries[(namespace, name)] = library


def unload() -> None:
    """Remove every op the fake defined."""
    libraries = _libraries()
    while libraries:
        libraries.popitem()[1]._destroy()
