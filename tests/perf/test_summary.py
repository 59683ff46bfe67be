"""perf/README.md's tables are what perf/summary.py generates from perf/baselines/*.json (so the
README cannot drift from the records); the device key; --record and --compare against a baseline."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from kernelmux import cli
from kernelmux.perf import records, summary

# The records are the checkout's (an installed kernelmux does not carry them).
PERF = pathlib.Path(__file__).resolve().parents[2] / "perf"

def test_readme_tables_equal_the_generated_ones():
    text = (PERF / "README.md").read_text()
    start, end = text.index(summary.BEGIN), text.index(summary.END) + len(summary.END)
    assert text[start:end] == summary.render(records.baselines(PERF / "baselines")), (
        "perf/README.md's tables differ from perf/baselines/*.json: run python -m kernelmux.perf.summary --write")


def test_every_baseline_is_named_by_its_device_key():
    runs = records.baselines(PERF / "baselines")
    assert runs, "perf/baselines holds no run"
    for key, run in runs.items():
        assert records.device_key(run["environment"]) == key
        assert records.baseline_path(key, PERF / "baselines").with_suffix(".md").exists()


@pytest.mark.parametrize("environment, key", [
    ({"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}, "h100"),
    ({"device": "cuda", "device_name": "NVIDIA H200"}, "h200"),
    ({"device": "cuda", "device_name": "NVIDIA H100 PCIe"}, "h100-pcie"),
    ({"device": "cuda", "device_name": "NVIDIA GeForce RTX 4090"}, "rtx4090"),
    ({"device": "cuda", "device_name": "AMD Instinct MI300X"}, "mi300x"),
    ({"device": "cuda", "device_name": "NVIDIA A100-SXM4-80GB"}, "a100"),
    ({"device": "cpu", "device_name": "AMD EPYC 7B13", "machine": "x86_64"}, "cpu-x86_64"),
    ({"device": "cpu", "device_name": "", "machine": "aarch64"}, "cpu-aarch64"),
])
def test_device_key(environment, key):
    assert records.device_key(environment) == key


def _row(backend, us=None, **extra):
    row = {"op": "op", "case": "c", "backend": backend, "status": "ok" if us else "declined", **extra}
    if us:
        row.update(median_us=us, roofline_pct=10.0)
    return row


def test_best_is_the_fastest_implementation_and_other_the_next_reference_included():
    rows = [_row("reference", 100.0), _row("triton", 20.0), _row("cuda", 10.0), _row("cpu")]
    [entry] = summary.best_rows({"rows": rows})
    assert entry["best"]["backend"] == "cuda" and entry["other"]["backend"] == "triton"
    [entry] = summary.best_rows({"rows": [_row("reference", 100.0), _row("triton", 200.0)]})
    # An implementation slower than the reference is still the best implementation; the reference is the other.
    assert entry["best"]["backend"] == "triton" and entry["other"]["backend"] == "reference"
    [entry] = summary.best_rows({"rows": [_row("reference", 100.0), _row("cuda")]})
    assert entry["best"]["backend"] == "reference" and entry["other"] is None


def _recording_into(tmp_path, monkeypatch):
    """perf/baselines and perf/README.md redirected to copies under tmp_path."""
    baselines, readme = tmp_path / "baselines", tmp_path / "README.md"
    shutil.copytree(PERF / "baselines", baselines)
    shutil.copy(PERF / "README.md", readme)
    monkeypatch.setattr(records, "BASELINES", baselines)
    monkeypatch.setattr(summary, "README", readme)
    return baselines, readme


def _every_model_case(run):
    """``run`` with a reference row (copied from one of its own) for each model case it lacks: a
    recorded baseline predates the ops and cases added after its bench, and a new one needs them all."""
    from kernelmux.specs import ALL_SPECS

    template = next(r for r in run["rows"] if r["backend"] == "reference" and r["status"] == "ok")
    have = {(r["op"], r["case"]) for r in run["rows"]}
    run["rows"] += [dict(template, op=spec.name, case=case.name) for spec in ALL_SPECS
                    for case in spec.model_cases(False, run["environment"]["device"])
                    if (spec.name, case.name) not in have]
    return run


def test_record_writes_the_runs_device_baseline_and_the_readme_tables(tmp_path, monkeypatch):
    baselines, readme = _recording_into(tmp_path, monkeypatch)
    run = _every_model_case(json.loads((baselines / "h100.json").read_text()))
    run["environment"].update(device_name="NVIDIA B200", commit="feedbee")  # a device with no baseline yet
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert not (baselines / "b200.json").exists()
    assert cli.main(["bench", "--load", str(tmp_path / "run.json"), "--record"]) == 0
    assert json.loads((baselines / "b200.json").read_text()) == run
    assert "# kernelmux bench: NVIDIA B200" in (baselines / "b200.md").read_text()
    assert "### b200: NVIDIA B200, bench feedbee" in readme.read_text()


def test_record_refuses_a_partial_run(tmp_path, monkeypatch, capsys):
    baselines, _ = _recording_into(tmp_path, monkeypatch)
    run = json.loads((baselines / "h100.json").read_text())
    run["rows"] = [r for r in run["rows"] if r["op"] == "grouped_topk"]
    run["environment"]["device_name"] = "NVIDIA B200"
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert cli.main(["bench", "--load", str(tmp_path / "run.json"), "--record"]) == 1
    assert "not recorded: a baseline covers every op" in capsys.readouterr().err
    assert not (baselines / "b200.json").exists()


def test_compare_without_a_file_reads_this_devices_baseline(tmp_path, monkeypatch, capsys):
    baselines, _ = _recording_into(tmp_path, monkeypatch)
    assert cli.main(["bench", "--load", str(baselines / "h100.json"), "--compare"]) == 0
    recorded = json.loads((baselines / "h100.json").read_text())["environment"]["commit"]
    assert f"compare: {recorded} against {recorded}" in capsys.readouterr().out
    (baselines / "h100.json").rename(tmp_path / "elsewhere.json")
    assert cli.main(["bench", "--load", str(tmp_path / "elsewhere.json"), "--compare"]) == 2
    assert "no baseline for this device" in capsys.readouterr().err
