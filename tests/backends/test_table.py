"""Every built-in backend registers through backends/_table.py: one table row per entry module
backends/<backend>/<op>.py and one entry module per row."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from kernelmux.backends._table import Defaults, Entry, Gap, implementations
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
    rows = [row.op for row in package.TABLE if isinstance(row, Entry)]
    gaps = [row.op for row in package.TABLE if isinstance(row, Gap)]
    assert rows and set(rows) == entries
    assert len(set(rows + gaps)) == len(rows + gaps), "an op is both served and a gap, or listed twice"


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


def test_a_gap_is_never_viable_and_says_why():
    from kernelmux.engine import Engine, Settings
    from kernelmux.errors import ImplementationError
    from kernelmux.platforms import PlatformKind
    from kernelmux.registry import PlatformRequirement, hookimpl

    class Plugin:
        @staticmethod
        @hookimpl
        def kernelmux_implementations():
            defaults = Defaults(priority=99, requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CPU})))
            return implementations("gappy", "unused", defaults, [Gap("ssd_scan", "no Mamba2 kernel in the library")])

    engine = Engine(ALL_SPECS, Settings.from_env().with_changes(platform="x86_64", allow_plugins=("reference",)),
                    plugins={"gappy": Plugin()})
    [rejected] = [impl for impl, reason in engine.tables["ssd_scan"].rejected if impl.backend == "gappy"]
    reasons = dict((impl.backend, reason) for impl, reason in engine.tables["ssd_scan"].rejected)
    assert reasons["gappy"] == "no kernel for ssd_scan: no Mamba2 kernel in the library"
    assert all(c.impl.backend != "gappy" for c in engine.tables["ssd_scan"].candidates)
    with pytest.raises(ImplementationError, match="has no kernel for it: no Mamba2 kernel"):
        rejected.fn()
    with pytest.raises(ValueError, match="no such spec"):
        Gap("ssd", "typo")
