"""Every built-in backend registers through backends/_table.py: one table row per entry module
backends/<backend>/<op>.py and one entry module per row."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.specs import ALL_SPECS

BACKENDS = pathlib.Path(__file__).resolve().parents[2] / "backends"
OPS = {spec.name for spec in ALL_SPECS}


# Every built-in backend with a table: the folders under backends/ but the reference (a comprehension).
TABLED = sorted(p.name for p in BACKENDS.iterdir() if (p / "__init__.py").exists() and p.name != "reference")


def test_every_builtin_backend_is_listed():
    assert {"cpu", "triton", "cuda", "flashinfer", "deepgemm", "torch"} <= set(TABLED)


@pytest.mark.parametrize("backend", TABLED)
def test_table_rows_are_the_entry_modules(backend):
    package = importlib.import_module(f"kernelmux.backends.{backend}")
    entries = {p.stem for p in (BACKENDS / backend).glob("*.py") if p.stem in OPS}
    assert [entry.op for entry in package.TABLE] and {entry.op for entry in package.TABLE} == entries


def test_an_entry_names_a_spec_and_fields_of_defaults():
    with pytest.raises(ValueError, match="no such spec"):
        Entry("paged_attn", "typo")
    with pytest.raises(ValueError, match="expected fields of Defaults"):
        Entry("paged_attention", "x", {"priorty": 3})


def test_implementations_take_the_entry_modules_function_and_supports():
    from kernelmux.backends.cpu import paged_attention as entry

    [record] = implementations("cpu", "kernelmux.backends.cpu", Defaults(priority=7),
                               [Entry("paged_attention", "d", {"devices": frozenset({"cpu"})})])
    assert (record.fn, record.supports, record.priority, record.devices) == (
        entry.paged_attention, getattr(entry, "supports", None), 7, frozenset({"cpu"}))
