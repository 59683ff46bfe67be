"""README.md's table of where each op lives is the tree's: every op's contract, its entry module on
every backend, and the records that hold its current numbers."""

from __future__ import annotations

import pathlib
import re

from kernelmux.specs import ALL_SPECS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rows() -> dict[str, list[str]]:
    """op -> its row's cells (contract, implementations, numbers) as written in README.md."""
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _paths(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_op_has_its_row():
    assert list(_rows()) == [spec.name for spec in ALL_SPECS]


def test_the_rows_name_the_trees_files():
    for op, (contract, implementations, numbers) in _rows().items():
        assert _paths(contract) == [f"specs/{op}.py"], op
        entries = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(f"backends/*/{op}.py"))
        assert sorted(_paths(implementations)) == entries, op
        assert (implementations == "reference only") == (not entries), op
        for path in _paths(contract) + _paths(numbers):
            assert (ROOT / path).exists(), f"{op}: {path} does not exist"
        decision = f"perf/decisions/{op}.md"
        assert (decision in _paths(numbers)) == (ROOT / decision).exists(), op
