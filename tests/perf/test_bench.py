"""kernelmux bench: rows checked before they are timed (a wrong implementation is reported, never
timed), ceilings timed as the rows are, the roofline and its above-ceiling flag, the reference's
bounded timing, reports and plots, --compare gating, and the command line's exit status."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import sys
import time
import types

import pytest
import torch

from kernelmux import cli
from kernelmux.backends import _vendor
from kernelmux.engine import Engine, Settings
from kernelmux.errors import ConfigurationError
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import grouped_topk as grouped_topk_spec
from kernelmux.perf import bench, ceilings, report, runner, timing
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
                                  **extra)  # any device: on a GPU machine the cases are on the GPU

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
        assert row["samples"] >= 1 and "flag" not in row
    assert cpu["max_rel_err"] < 1e-5 and "max_rel_err" not in ref  # the reference defines the expected outputs
    assert cpu["speedup_vs_reference"] == pytest.approx(ref["median_us"] / cpu["median_us"])
    assert cpu["speedup_vs_baseline"] == pytest.approx(1.0)  # the baseline is cpu itself
    assert ref["speedup_vs_reference"] == pytest.approx(1.0)


def test_result_records_environment_ceilings_and_method(result):
    assert result["schema"] == bench.SCHEMA == "kernelmux.bench/2"
    env = result["environment"]
    for key in ("device_name", "torch", "kernelmux", "commit", "timestamp", "python", "threads"):
        assert env[key], key
    assert result["ceilings"] == CEILINGS
    method = result["method"]
    assert method["timing"]["threads"] == env["threads"] and method["timing"]["budget_s"] == 0.01
    assert method["reference"]["min_calls"] == 1 and method["reference"]["warmup"] == 0
    assert set(result["wall_s"]) == {*bench.WALL_PHASES, "total"}
    assert sum(v for k, v in result["wall_s"].items() if k != "total") <= result["wall_s"]["total"]
    json.dumps(result)  # serializable as is


def test_rate_falls_back_to_the_next_measured_precision():
    assert runner._rate({"fp8_tflops": 1900.0, "bf16_tflops": 990.0}, "fp4") == (1900.0, "fp8")
    assert runner._rate({"fp8_tflops": None, "bf16_tflops": 2.0}, "fp8") == (2.0, "bf16")
    assert runner._rate({"fp32_tflops": 1.0}, "fp32") == (1.0, "fp32")


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
    # Each ceiling as the rows are timed, beside its one-call-at-a-time twin where there is one;
    # three significant digits, so a CPU's 0.0268 TFLOP/s does not print as 0.0.
    assert "| bf16 | 0.5 TFLOP/s | 0.7 TFLOP/s |" in text
    assert "| memory | 10 GB/s | - |" in text
    assert ("2 row(s) failed (wrong or error): grouped_topk/deepseek_v3_t64/crashing, "
            "grouped_topk/deepseek_v3_t64/wrong.") in text


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


def test_unknown_op_is_a_usage_error(capsys):
    assert cli.main(["bench", "no_such_op"]) == 2
    assert "unknown op 'no_such_op'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Ceilings timed as the rows are; a row above its ceiling is a ceiling problem (issue 24, item 14)


def test_cpu_bf16_ceiling_is_a_bf16_route_of_this_cpu():
    # torch's bf16 GEMM on a CPU without bf16 instructions is a scalar fallback (0.001 TFLOP/s on
    # the 2-core AVX2 VM, 190x under fp32): a bf16 kernel converts and runs fp32 FMAs there, so
    # the bf16 ceiling is never below the fp32 one by more than noise (same problem, same timer).
    measured = ceilings.measure("cpu", quick=True)
    assert measured["bf16_tflops"] >= 0.5 * measured["fp32_tflops"], measured


def test_ceilings_are_timed_with_the_rows_threads_timer_warmup_and_repetitions(monkeypatch):
    events = []
    original = timing.wall_time

    def recording(fn, **kwargs):
        events.append(("timed", dict(kwargs, threads=torch.get_num_threads())))
        return original(fn, **kwargs)

    monkeypatch.setattr(timing, "wall_time", recording)
    plan = _plan(backends=["cpu"], cases=["deepseek_v3_t1"], budget_s=0.01)
    result = bench.run(plan, progress=lambda line: events.append(("progress", line)))
    starts = [i for i, (kind, line) in enumerate(events) if kind == "progress" and "measuring ceilings" in line]
    ends = [i for i, (kind, line) in enumerate(events) if kind == "progress" and line.startswith("ceilings")]
    ceiling_calls = [params for kind, params in events[starts[0]:ends[0]] if kind == "timed"]
    row_calls = [params for kind, params in events[ends[0]:] if kind == "timed"]
    rows_method = {"reps": 200, "budget_s": 0.01, "warmup": 2, "min_calls": 3,
                   "threads": torch.get_num_threads()}
    assert len(ceiling_calls) >= 2, events  # the copy and the fp32 matmul at least (bf16 may reuse fp32's)
    assert all(params == rows_method for params in ceiling_calls), ceiling_calls
    assert rows_method in row_calls, row_calls  # the cpu row
    assert result["method"]["ceilings"]["timer"] == "wall-clock"


def test_a_row_above_its_ceiling_is_flagged_and_never_given_a_percentage():
    engine = Engine(ALL_SPECS, Settings())
    tiny = {"memory_gbps": 1e-6, "bf16_tflops": 1e-9, "fp8_tflops": None, "fp32_tflops": 1e-9}
    result = bench.run(_plan(backends=["cpu"]), progress=lambda line: None, engine=engine, ceilings=tiny)
    lines = [report.describe(row) for row in result["rows"]]
    for row, line in zip(result["rows"], lines):
        assert row["flag"] == "above-ceiling" and "roofline_pct" not in row, row
        seconds = row["median_us"] / 1e6
        memory_s, compute_s = row["bytes"] / 1e3, row["flops"] / 1e3
        assert row["ceiling_ratio"] == pytest.approx(max(memory_s, compute_s) / seconds)
        assert row["ceiling"] == ("memory_gbps" if memory_s >= compute_s else "bf16_tflops")
        assert f"ABOVE-CEILING: {row['ceiling_ratio']:.2f}x the {row['ceiling']} ceiling" in line
        assert "%" not in line
    text = bench.markdown(result)
    cpu = next(r for r in result["rows"] if r["backend"] == "cpu")
    assert "| ok, above-ceiling | " in text
    assert f"| above-ceiling ({cpu['ceiling_ratio']:.2f}x {cpu['ceiling']}) |" in text
    assert "2 row(s) ran faster than their ceiling allows" in text


# ---------------------------------------------------------------------------------------------
# The reference: one correctness call, then a bounded timing (issue 24, item 15)


def _engine_with_slow_reference(seconds: float, calls: list):
    real = grouped_topk_spec.SPEC.reference

    @functools.wraps(real)
    def slow(*args, **kwargs):
        calls.append(time.perf_counter())
        time.sleep(seconds)
        return real(*args, **kwargs)

    spec = dataclasses.replace(grouped_topk_spec.SPEC, reference=slow)
    return Engine([spec if s.name == "grouped_topk" else s for s in ALL_SPECS], Settings())


def test_a_slow_reference_is_called_once_for_correctness_and_timed_within_its_budget():
    calls = []
    engine = _engine_with_slow_reference(0.2, calls)
    result = bench.run(_plan(backends=["cpu"], budget_s=0.05), progress=lambda line: None, engine=engine,
                       ceilings=dict(CEILINGS))
    ref, cpu = _row(result, "reference"), _row(result, "cpu")
    # Its correctness call was the warm-up; one timed call past the 0.05 s budget ends it (the
    # rows' method would have made 2 warm-ups and 3 timed calls, graph replay ~1000 on a GPU).
    assert len(calls) == 2 and ref["samples"] == 1 and ref["timer"] == "wall-clock"
    assert ref["median_us"] >= 0.2e6
    assert cpu["speedup_vs_reference"] == pytest.approx(ref["median_us"] / cpu["median_us"])
    assert result["method"]["reference"]["budget_s"] == 0.05


def test_a_reference_past_the_call_limit_is_not_timed_and_says_so():
    calls = []
    engine = _engine_with_slow_reference(1.1, calls)  # past REFERENCE_CALL_LIMIT_S, 1 s
    result = bench.run(_plan(backends=["cpu"]), progress=lambda line: None, engine=engine,
                       ceilings=dict(CEILINGS))
    ref, cpu = _row(result, "reference"), _row(result, "cpu")
    assert len(calls) == 1 and "median_us" not in ref and ref["status"] == "ok"
    assert bench.REFERENCE_CALL_LIMIT_S == 1.0
    assert "took 1.1 s" in ref["not_timed"]
    assert cpu["speedup_vs_reference"] is None and "median_us" in cpu
    assert "reference not timed" in report.describe(cpu)
    text = bench.markdown(result)
    assert "| reference | ok | not timed: one call took 1.1 s" in text and "| not timed | 1.00x |" in text


def test_reference_timing_never_captures_and_keeps_the_rows_timer():
    method = timing.Method.for_run("cuda", quick=False)
    ref = bench.reference_method(method)
    assert (ref.capture, ref.warmup, ref.min_calls, ref.budget_s) == (False, 0, 1, bench.REFERENCE_BUDGET_S)
    assert (ref.device, ref.max_calls, ref.threads) == (method.device, method.max_calls, method.threads)
    # Never above the rows' budget:
    assert bench.reference_method(timing.Method.for_run("cpu", quick=True)).budget_s == 0.05


def test_progress_states_the_method_and_the_time_left(result):
    lines = []
    bench.run(_plan(backends=["cpu"]), progress=lines.append, engine=Engine(ALL_SPECS, Settings()),
              ceilings=dict(CEILINGS))
    assert "1 cases of 1 op(s); rows and ceilings timed by wall clock" in lines[0]
    assert "then timed within 0.01 s" in lines[1]
    assert all("s left] grouped_topk deepseek_v3_t64" in line for line in lines if line.startswith("[1/1"))
    assert lines[-1].startswith("wall time ceilings")


# ---------------------------------------------------------------------------------------------
# The exit status (issue 24, item 16)


def _with_test_plugin(monkeypatch):
    """The command line's engine gets the test plugin; its ceilings are CEILINGS (not measured:
    this is about the exit status)."""
    monkeypatch.setattr(bench, "Engine", lambda specs, settings: Engine(specs, settings,
                                                                      plugins={"bench_test": _TestPlugin()}))
    monkeypatch.setattr(ceilings, "measure", lambda *args, **kwargs: dict(CEILINGS))
    monkeypatch.setattr(ceilings, "measure_run", lambda *args, **kwargs: (dict(CEILINGS), {}), raising=False)


@pytest.mark.parametrize("backend, status", [("wrong", 1), ("crashing", 1), ("declining", 0), ("cpu", 0)])
def test_exit_status_fails_on_wrong_or_error_rows_and_names_them(monkeypatch, capsys, tmp_path, backend,
                                                                 status):
    _with_test_plugin(monkeypatch)
    saved = tmp_path / "run.json"
    argv = ["bench", "grouped_topk", "--case", "deepseek_v3_t1", "--quick", "--budget", "0.01",
            "--backend", backend]
    assert cli.main(argv + ["--json", str(saved)]) == status
    err = capsys.readouterr().err
    named = f"grouped_topk/deepseek_v3_t1/{backend}: "
    assert (named in err and "1 row(s) failed" in err) == bool(status), err
    # A saved run re-reported says the same.
    assert cli.main(["bench", "--load", str(saved)]) == status


# ---------------------------------------------------------------------------------------------
# Plots: a roofline and a speed-up chart, from the data functions (issue 24, item 17)


def _synthetic():
    def row(op, case, backend, flops, nbytes, median_us, **extra):
        return {"op": op, "case": case, "backend": backend, "status": "ok", "flops": flops, "bytes": nbytes,
                "matmul": "bf16", "median_us": median_us, "p20_us": median_us, "p80_us": median_us,
                "samples": 3, "timer": "cuda-graph", "bound": "memory", "roofline_pct": 50.0, **extra}

    rows = [
        row("paged_attention", "decode", "reference", 2_000_000, 1_000_000, 100.0),
        row("paged_attention", "decode", "triton", 2_000_000, 1_000_000, 10.0),
        row("paged_attention", "decode", "cuda", 2_000_000, 1_000_000, 8.0),
        row("paged_attention", "decode", "other", 2_000_000, 1_000_000, 16.0),
        {"op": "paged_attention", "case": "decode", "backend": "declining", "status": "declined",
         "flops": 2_000_000, "bytes": 1_000_000, "matmul": "bf16", "message": "no"},
        row("kv_cache_write", "t1024", "reference", 0, 4_000_000, 40.0),
        row("kv_cache_write", "t1024", "triton", 0, 4_000_000, 2.0),
        row("mla_decode", "b64", "cuda", 8_000_000_000, 1_000_000, 1000.0, flag="above-ceiling",
            ceiling="bf16_tflops", ceiling_ratio=1.2),
    ]
    for r in rows:
        if r.get("flag"):
            r.pop("roofline_pct")
    return {"schema": bench.SCHEMA,
            "environment": {"device_name": "NVIDIA H100 80GB HBM3", "commit": "abc1234"},
            "ceilings": {"memory_gbps": 3000.0, "bf16_tflops": 700.0, "fp8_tflops": 1300.0,
                         "fp32_tflops": None},
            "rows": rows}


def test_roofline_points_are_the_timed_rows_by_intensity_and_achieved_rate():
    points = bench.roofline_points(_synthetic())
    assert [(p["op"], p["backend"]) for p in points] == [
        ("paged_attention", "reference"), ("paged_attention", "triton"), ("paged_attention", "cuda"),
        ("paged_attention", "other"), ("mla_decode", "cuda")]  # declined: untimed; kv_cache_write: no flops
    cuda = points[2]
    assert cuda["intensity"] == pytest.approx(2.0) and cuda["tflops"] == pytest.approx(2e6 / 8e-6 / 1e12)
    assert points[-1]["above"] and not cuda["above"]
    assert points[-1]["tflops"] == pytest.approx(8.0)
    assert bench.roofline_ceilings(_synthetic()) == {"memory_gbps": 3000.0, "bf16_tflops": 700.0,
                                                     "fp8_tflops": 1300.0}


def test_speedups_are_against_the_fastest_other_implementation():
    bars = {(b["case"], b["backend"]): b for b in bench.speedups(_synthetic())}
    # decode: cuda 8 us, triton 10, other 16; the reference takes no part. t1024 and b64: no peer.
    assert set(bars) == {("decode", "cuda"), ("decode", "triton"), ("decode", "other")}
    def versus(backend):
        return bars["decode", backend]["versus"], bars["decode", backend]["speedup"]

    assert versus("cuda") == ("triton", pytest.approx(10 / 8))
    assert versus("triton") == ("cuda", pytest.approx(0.8))
    assert versus("other") == ("cuda", pytest.approx(0.5))
    assert bars["decode", "other"]["median_us"] == 16.0 and bars["decode", "other"]["versus_us"] == 8.0


def test_plot_writes_the_roofline_and_the_speedup_chart_from_a_saved_run(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (kernelmux[bench]; [test] has it)")
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(_synthetic()))
    assert cli.main(["bench", "--load", str(saved), "--plot", str(tmp_path / "bench.png")]) == 0
    for name in ("bench.png", "bench_speedup.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert bench.speedup_path("out/run.x.png") == "out/run.x_speedup.png"


def test_load_upgrades_a_v1_result_and_flags_its_rows_above_100_percent(tmp_path):
    old = _synthetic()
    old["schema"] = "kernelmux.bench/1"
    above = old["rows"][-1]
    above.update(roofline_pct=120.0, bound="compute")
    for key in ("flag", "ceiling", "ceiling_ratio"):
        above.pop(key)
    upgraded = bench.upgrade(copy.deepcopy(old))
    row = upgraded["rows"][-1]
    assert upgraded["schema"] == bench.SCHEMA and upgraded["upgraded_from"] == "kernelmux.bench/1"
    assert (row["flag"], row["ceiling"], row["ceiling_ratio"]) == ("above-ceiling", "bf16_tflops", 1.2)
    assert "roofline_pct" not in row and upgraded["rows"][1]["roofline_pct"] == 50.0
    with pytest.raises(ConfigurationError, match="schema 'kernelmux.bench/0'"):
        bench.upgrade({"schema": "kernelmux.bench/0", "rows": []})


def test_an_implementations_metadata_is_timed_apart_and_first_calls_are_reported(monkeypatch):
    # An entry module's metadata(kwargs) (a block table's conversion, a vendor's plan) is timed on
    # its own; the vendors' first calls (JIT compiles) are listed, never folded into a row.
    module = types.ModuleType("kernelmux_test_planned")
    seen = []
    module.metadata = lambda kwargs: seen.append(sorted(kwargs)) or time.sleep(0.002)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    fn = _keywords(grouped_topk_spec.grouped_topk)
    fn.__module__ = module.__name__

    class Planned:
        @hookimpl
        def kernelmux_implementations(self):
            return [Implementation(op="grouped_topk", backend="planned", fn=fn,
                                   spec_version=grouped_topk_spec.SPEC.version, priority=50)]

    firsts = _vendor._FirstCalls()
    firsts.run(_vendor.Vendor("fakevendor", "fake-vendor", ((0,), (1,))), "grouped_topk", ("bf16", 256), "nowhere",
               lambda: None)
    monkeypatch.setattr(runner, "first_calls", firsts)
    engine = Engine(ALL_SPECS, Settings(), plugins={"planned": Planned()})
    result = bench.run(_plan(), progress=lambda line: None, engine=engine, ceilings=dict(CEILINGS))
    planned = _row(result, "planned")
    assert planned["metadata_us"] >= 2000 and planned["median_us"] < planned["metadata_us"]  # timed apart
    assert seen and "gating_output" in seen[0]
    assert "of which metadata and planning" in report.describe(planned)
    assert "cpu" in {r["backend"] for r in result["rows"]} and "metadata_us" not in _row(result, "cpu")
    [first] = result["first_calls"]
    assert first["vendor"] == "fakevendor" and first["variant"] == "('bf16', 256)"
    text = report.markdown(result)
    assert "grouped_topk/deepseek_v3_t64/planned" in text and "fakevendor grouped_topk ('bf16', 256)" in text


def test_in_place_ops_are_checked_on_the_inputs_the_reference_saw():
    # selective_state_update advances its state in place: timing the reference moves the case's
    # inputs on, so an implementation checked after that timing would be compared with outputs of
    # other inputs (every flashinfer row was "wrong" that way on the H100 at 220d0ef).
    from kernelmux.specs import selective_state_update as ssu_spec

    reference = ssu_spec.SPEC.reference

    @functools.wraps(reference)
    def same(*args, **kwargs):
        return reference(*args, **kwargs)

    class Same:
        @hookimpl
        def kernelmux_implementations(self):
            return [Implementation(op="selective_state_update", backend="same", fn=same,
                                   spec_version=ssu_spec.SPEC.version, priority=50)]

    engine = Engine(ALL_SPECS, Settings(), plugins={"same": Same()})
    plan = _plan(ops=["selective_state_update"], cases=["small_permuted"], baseline=None)
    result = bench.run(plan, progress=lambda line: None, engine=engine, ceilings=dict(CEILINGS))
    row = _row(result, "same")
    assert row["status"] == "ok" and row["max_rel_err"] == 0.0, row


def test_a_deadline_starts_no_case_late_and_the_run_keeps_what_it_measured(monkeypatch):
    now = [0.0]  # the deadline's clock: still until the first case is reported, then 10 s later
    monkeypatch.setattr(runner, "_deadline_clock", lambda: now[0])
    lines = []

    def progress(line):
        lines.append(line)
        if line.startswith("[1/"):
            now[0] += 10.0

    cases = ["deepseek_v3_t1", "deepseek_v3_t64", "small_sigmoid_bias"]
    engine = Engine(ALL_SPECS, Settings(tuning=False))
    partial = bench.run(_plan(cases=cases, deadline_s=5.0), progress=progress, engine=engine, ceilings=dict(CEILINGS))
    assert {r["case"] for r in partial["rows"]} == {"deepseek_v3_t1"}
    assert partial["not_run"] == ["grouped_topk/deepseek_v3_t64", "grouped_topk/small_sigmoid_bias"]
    assert "deadline: 5 s passed; 2 case(s) not run" in lines
    full = bench.run(_plan(cases=cases[:1]), progress=lambda line: None, engine=engine, ceilings=dict(CEILINGS))
    assert full["not_run"] == []


def test_a_run_cut_at_its_deadline_is_reported_and_never_recorded(tmp_path, capsys):
    run = json.loads(json.dumps(bench.run(_plan(cases=["deepseek_v3_t1"]), progress=lambda line: None,
                                          engine=Engine(ALL_SPECS, Settings(tuning=False)),
                                          ceilings=dict(CEILINGS))))
    run["not_run"] = ["grouped_topk/deepseek_v3_t64"]
    run["method"]["quick"] = False
    run["selection"] = [dict(op="grouped_topk", case="deepseek_v3_t1", chosen="cpu", chosen_us=2.0, fastest="cpu",
                             fastest_us=2.0, ratio=1.0, mismatch=False)]
    assert report.selection_line(run).startswith("Stopped at the deadline: 1 case(s) not run. Selection: on 1 of 1")
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert cli.main(["bench", "--load", str(tmp_path / "run.json"), "--record"]) == 1
    assert "not recorded: the run stopped at its deadline before 1 case(s)" in capsys.readouterr().err


def _part(result, case=None, scale=1.0, **environment):
    """A copy of ``result`` as another part of one bench: its case renamed, its times scaled, its
    environment changed."""
    part = copy.deepcopy(result)
    old = result["rows"][0]["case"]
    case = case or old
    for row in part["rows"]:
        row["case"] = case
        if "median_us" in row:
            row["median_us"] *= scale
    for choice in part["selection"]:
        choice["case"] = case
    part["buckets"] = {f"grouped_topk/{case}": bucket for bucket in part["buckets"].values()}
    part["environment"].update(environment)
    return part


def test_parts_of_one_bench_merge_into_one_run(result):
    first = _part(result)
    first["not_run"] = ["grouped_topk/second_case"]
    second = _part(result, case="second_case", scale=2.0, timestamp="later")
    merged = bench.merge([first, second], ["a.json", "b.json"])
    assert [r["case"] for r in merged["rows"]] == ["deepseek_v3_t64"] * len(result["rows"]) + \
        ["second_case"] * len(result["rows"])
    assert merged["not_run"] == []  # the second part measured what the first could not
    assert set(merged["buckets"]) == {"grouped_topk/deepseek_v3_t64", "grouped_topk/second_case"}
    assert [c["case"] for c in merged["selection"]] == [c["case"] for c in first["selection"] + second["selection"]]
    assert [(p["timestamp"], p["cases"], p["ops"]) for p in merged["parts"]] == \
        [(result["environment"]["timestamp"], 1, ["grouped_topk"]), ("later", 1, ["grouped_topk"])]
    assert merged["wall_s"]["total"] == pytest.approx(2 * result["wall_s"]["total"])
    assert "Merged from 2 runs" in report.markdown(merged)


def test_a_later_part_replaces_an_earlier_ones_case_and_a_case_no_part_ran_stays_not_run(result):
    first = _part(result)
    first["not_run"] = ["grouped_topk/never_run"]
    again = _part(result, scale=3.0)
    merged = bench.merge([first, again], ["a.json", "b.json"])
    timed = [r for r in merged["rows"] if "median_us" in r]
    assert timed and all(r["median_us"] == pytest.approx(3.0 * _row(result, r["backend"])["median_us"])
                         for r in timed)
    assert len(merged["rows"]) == len(result["rows"])
    assert merged["not_run"] == ["grouped_topk/never_run"]
    assert [p["cases"] for p in merged["parts"]] == [0, 1]


def test_runs_of_another_commit_or_method_do_not_merge(result):
    with pytest.raises(ConfigurationError, match=r"cannot merge b.json into a.json: environment.commit is "
                                                 r"'other', expected"):
        bench.merge([_part(result), _part(result, commit="other")], ["a.json", "b.json"])
    slower = _part(result)
    slower["method"]["budget_s"] = 9.0
    with pytest.raises(ConfigurationError, match="method.budget_s is 9.0"):
        bench.merge([_part(result), slower], ["a.json", "b.json"])


def test_command_line_merges_repeated_loads_and_records_only_a_full_bench(result, tmp_path, capsys):
    first, second = _part(result), _part(result, case="second_case")
    for part in (first, second):
        part["method"]["quick"] = False
        part["rows"] = [r for r in part["rows"] if r["status"] not in bench.FAILED]  # the fixture's failing rows
    first["not_run"] = ["grouped_topk/second_case"]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, (first, second)):
        path.write_text(json.dumps(part))
    loads = [arg for path in paths for arg in ("--load", str(path))]
    assert cli.main(["bench", *loads, "--json", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert len(merged["parts"]) == 2 and merged["not_run"] == []
    # The merge is whole, but it is not every op's model cases: no baseline.
    assert cli.main(["bench", *loads, "--record"]) == 1
    assert "not recorded: a baseline covers every op's model cases; this run lacks grouped_topk/" in \
        capsys.readouterr().err
