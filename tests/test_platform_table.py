"""README's ops x platforms table is what tests/platform_table.py generates (so no cell can claim
more than the dry run and the recorded benches show), and the dry run it comes from is real: every
vendor backend is installed (as its fake) and loads, and each mark follows its evidence."""

from __future__ import annotations

import pytest

import platform_table


@pytest.fixture(scope="module")
def infos():
    return platform_table.selections()


def test_readme_table_equals_the_generated_one(infos):
    text = platform_table.README.read_text()
    start = text.index(platform_table.BEGIN)
    end = text.index(platform_table.END) + len(platform_table.END)
    assert text[start:end] == platform_table.render(infos, platform_table.evidence()), (
        "README's platform table differs from the dry run: run python tests/platform_table.py --write")


def test_every_vendor_backend_loads_in_the_dry_run(infos):
    for platform, info in infos.items():
        assert not info["quarantined"], (platform, info["quarantined"])
        for op in info["ops"]:
            for rejected in op["rejected"]:
                assert "is not installed" not in rejected["reason"], (platform, op["op"], rejected)


def test_a_cell_marks_only_what_a_recorded_bench_shows():
    info = {"kind": "cuda", "arch": "sm_90"}
    op = {"op": "scaled_mm", "viable": [
        {"backend": "deepgemm", "devices": ["cuda"]},
        {"backend": "cpu", "devices": ["cpu"]},  # kept on any platform, but its tensors cannot live there
        {"backend": "torch", "devices": ["cuda"]},
        {"backend": "reference", "devices": []},
    ]}
    ran = {("sm_90", "scaled_mm", "torch"), ("sm_100", "scaled_mm", "deepgemm")}
    assert platform_table._cell(op, info, ran) == "deepgemm ◌, torch ✔"
    assert platform_table._cell({"op": "ssd_scan", "viable": [{"backend": "reference", "devices": []}]},
                                info, ran) == "-"
    rocm = {"kind": "rocm", "arch": "gfx942"}  # ROCm tensors are torch "cuda" tensors
    assert platform_table._cell(op, rocm, set()) == "deepgemm ◌, torch ◌"


def test_evidence_is_the_ok_rows_of_the_recorded_benches(tmp_path):
    import json

    rows = [{"op": "a", "backend": "x", "status": "ok"}, {"op": "a", "backend": "y", "status": "declined"},
            {"op": "b", "backend": "x", "status": "wrong"}]
    (tmp_path / "h100.json").write_text(json.dumps({"environment": {"arch": "sm_90"}, "rows": rows}))
    assert platform_table.evidence(tmp_path) == {("sm_90", "a", "x")}
