"""kernelmux bench: rows checked before they are timed (a wrong implementation is reported, never
timed), roofline arithmetic, reports, --compare gating, and the command line end to end."""

from __future__ import annotations

import copy
import functools
import inspect
import json

import pytest
import torch

from kernelmux import cli
from kernelmux.engine import Engine, Settings
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.ops.specs import grouped_topk as grouped_topk_spec
from kernelmux.perf import bench, ceilings
from kernelmux.registry import Implementation, hookimpl

CEILINGS = {"memory_gbps": 10.0, "bf16_tflops": 0.5, "fp8_tflops": None, "fp32_tflops": 0.25,
            "bf16_tflops_burst": 0.7}


class _TestPlugin:
    """A wrong implementation (weights doubled), one that declines everything, one that raises."""

    @hookimpl
    def kernelmux_implementations(self):
        def doubled(**kwargs):
            weights, ids = grouped_topk_spec.grouped_topk(**kwargs)
            return weights * 2, ids

        def raises(**kwargs):
            raise RuntimeError("kernel launch failed")

        def impl(backend, fn, **extra):
            return Implementation(op="grouped_topk", backend=backend, fn=_keywords(fn),
                                  spec_version=grouped_topk_spec.SPEC.version, priority=50,
                                  devices=frozenset({"cpu"}), **extra)

        return [
            impl("wrong", doubled),
            impl("declining", grouped_topk_spec.grouped_topk, supports=lambda *a, **k: "not today"),
            impl("crashing", raises),
        ]


def _keywords(fn):
    """An implementation with the spec's exact signature (the registry checks it) calling ``fn``
    with keyword arguments."""
    signature = inspect.signature(grouped_topk_spec.grouped_topk)

    @functools.wraps(grouped_topk_spec.grouped_topk)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return fn(**bound.arguments)

    return call


def _plan(**changes):
    base = dict(ops=["grouped_topk"], backends=None, cases=["deepseek_v3_t64"], quick=True, baseline="cpu",
                flush_l2=False, budget_s=0.01, seed=3, device="cpu")
    base.update(changes)
    return bench.Plan(**base)


@pytest.fixture(scope="module")
def result():
    engine = Engine(ALL_SPECS, Settings(), plugins={"bench_test": _TestPlugin()})
    return bench.run(_plan(), progress=lambda line: None, engine=engine, ceilings=dict(CEILINGS))


def _row(result, backend):
    return next(r for r in result["rows"] if r["backend"] == backend)


def test_a_wrong_implementation_is_reported_and_never_timed(result):
    row = _row(result, "wrong")
    assert row["status"] == "wrong" and "median_us" not in row
    assert "grouped_topk" in row["message"]
    assert row["max_rel_err"] == pytest.approx(1.0)  # doubled weights: |2w - w| / |w|


def test_declines_and_crashes_are_rows_with_their_reason(result):
    assert _row(result, "declining")["status"] == "declined"
    assert _row(result, "declining")["message"] == "not today"
    crashing = _row(result, "crashing")
    assert crashing["status"] == "error" and "kernel launch failed" in crashing["message"]


def test_ok_rows_carry_time_rates_roofline_and_speedups(result):
    ref, cpu = _row(result, "reference"), _row(result, "cpu")
    for row in (ref, cpu):
        assert row["status"] == "ok" and row["timer"] == "wall-clock"
        assert 0 < row["p20_us"] <= row["median_us"] <= row["p80_us"]
        seconds = row["median_us"] / 1e6
        assert row["gbps"] == pytest.approx(row["bytes"] / seconds / 1e9)
        assert row["tflops"] == pytest.approx(row["flops"] / seconds / 1e12)
        floor = max(row["bytes"] / 10e9, row["flops"] / 0.5e12)
        assert row["roofline_pct"] == pytest.approx(100 * floor / seconds)
        assert row["max_rel_err"] == 0.0 or row["backend"] != "reference"
    assert cpu["speedup_vs_reference"] == pytest.approx(ref["median_us"] / cpu["median_us"])
    assert cpu["speedup_vs_baseline"] == pytest.approx(1.0)  # the baseline is cpu itself
    assert ref["speedup_vs_reference"] == pytest.approx(1.0)


def test_result_records_environment_ceilings_and_method(result):
    assert result["schema"] == bench.SCHEMA
    env = result["environment"]
    for key in ("device_name", "torch", "kernelmux", "commit", "timestamp", "python", "threads"):
        assert env[key], key
    assert result["ceilings"] == CEILINGS
    json.dumps(result)  # serializable as is


def test_rate_falls_back_to_the_next_measured_precision():
    assert bench._rate({"fp8_tflops": 1900.0, "bf16_tflops": 990.0}, "fp4") == (1900.0, "fp8")
    assert bench._rate({"fp8_tflops": None, "bf16_tflops": 2.0}, "fp8") == (2.0, "bf16")
    assert bench._rate({"fp32_tflops": 1.0}, "fp32") == (1.0, "fp32")


def test_error_stats_are_normwise_and_nan_aware():
    expected = torch.tensor([1.0, -2.0, float("nan"), 4.0])
    actual = torch.tensor([1.0, -2.5, float("nan"), 4.0])
    stats = bench.error_stats(actual, expected)
    assert stats["max_rel_err"] == pytest.approx(0.5 / 4.0)
    assert stats["rms_rel_err"] == pytest.approx((0.25 / 4) ** 0.5 / ((1 + 4 + 16) / 4) ** 0.5)
    ids = bench.error_stats(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4]))
    assert ids == {"max_rel_err": 0.25, "rms_rel_err": 0.25}


def test_compare_passes_identical_runs_and_catches_a_slowed_row(result):
    lines = []
    assert bench.compare(result, result, 10.0, out=lines.append) == 0
    slowed = copy.deepcopy(result)
    _row(slowed, "cpu")["median_us"] *= 1.5
    assert bench.compare(slowed, result, 10.0, out=lines.append) == 1
    assert any("REGRESSION" in line and "cpu" in line for line in lines)
    assert bench.compare(slowed, result, 60.0, out=lines.append) == 0  # within a looser threshold
    broken = copy.deepcopy(result)
    _row(broken, "cpu").pop("median_us")
    _row(broken, "cpu")["status"] = "wrong"
    assert bench.compare(broken, result, 10.0, out=lines.append) == 1


def test_markdown(result):
    text = bench.markdown(result)
    assert "| grouped_topk | deepseek_v3_t64 | cpu | ok |" in text
    assert "| grouped_topk | deepseek_v3_t64 | wrong | wrong |" in text
    # Each ceiling as the rows are timed, beside its one-call-at-a-time twin where there is one.
    assert "| bf16 | 0.5 TFLOP/s | 0.7 TFLOP/s |" in text
    assert "| memory | 10.0 GB/s | - |" in text


def test_plot(result, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (kernelmux[bench]; [test] has it)")
    path = tmp_path / "bench.png"
    bench.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_ceilings_are_measured():
    measured = ceilings.measure("cpu", quick=True)
    assert measured["memory_gbps"] > 0.1 and measured["bf16_tflops"] > 0 and measured["fp32_tflops"] > 0
    assert measured["fp8_tflops"] is None
    assert ceilings.datasheet("NVIDIA H200")["memory_gbps"] == 4800.0
    assert ceilings.datasheet("Intel(R) Xeon(R)") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU ceilings need a CUDA device (run on the GPU)")
def test_cuda_ceilings_are_measured_sustained_and_in_bursts():
    measured = ceilings.measure("cuda", quick=True)
    has_fp8 = torch.cuda.get_device_capability() >= (8, 9)
    for name in ("memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops"):
        for key in (name, f"{name}_burst"):
            if name == "fp8_tflops" and not has_fp8:
                assert measured[key] is None
            else:
                assert measured[key] > 0, (key, measured)
    # The same matmul both ways: the load changes the clock, not the order of magnitude. (No
    # order between them: quick's small matmuls time their launch too when called one at a time.)
    assert 0.5 < measured["bf16_tflops"] / measured["bf16_tflops_burst"] < 2.0, measured
    copy_only = ceilings.measure("cuda", quick=True, only=("memory_gbps",))
    assert set(copy_only) == {"memory_gbps", "memory_gbps_burst"}, copy_only
    assert 0.5 < copy_only["memory_gbps"] / measured["memory_gbps"] < 2.0, (copy_only, measured)


def test_ceilings_refuse_an_unknown_name():
    with pytest.raises(ValueError, match=r"only takes names from .* got \['hbm_gbps'\]"):
        ceilings.measure("cuda", only=("memory_gbps", "hbm_gbps"))


def test_command_line_runs_writes_reports_and_gates(tmp_path, capsys):
    run_json = tmp_path / "run.json"
    argv = ["bench", "grouped_topk", "--case", "deepseek_v3_t1", "--quick", "--budget", "0.01",
            "--json", str(run_json), "--md", str(tmp_path / "run.md")]
    assert cli.main(argv) == 0
    saved = json.loads(run_json.read_text())
    assert "reference" in {r["backend"] for r in saved["rows"]} and len(saved["rows"]) >= 2
    assert (tmp_path / "run.md").read_text().startswith("# kernelmux bench")
    # --load re-reports a saved run; --compare gates on it.
    assert cli.main(["bench", "--load", str(run_json), "--compare", str(run_json)]) == 0
    faster = copy.deepcopy(saved)
    for row in faster["rows"]:
        if "median_us" in row:
            row["median_us"] /= 2  # the old run was twice as fast: everything regressed
    old_json = tmp_path / "old.json"
    old_json.write_text(json.dumps(faster))
    assert cli.main(["bench", "--load", str(run_json), "--compare", str(old_json)]) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_unknown_op_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown op"):
        cli.main(["bench", "no_such_op"])
