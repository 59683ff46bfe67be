"""kernelmux tune and the bench's selection check: a run records each case's bucket, the versions and
the device it measured, and chosen-vs-fastest; a table made from it (measured or --load'ed) orders
the engine's calls on this machine."""

from __future__ import annotations

import json

import pytest
import torch

from fakes import Counter, FakePlugin, fake_impl
from kernelmux import cli
from kernelmux.engine import Engine, Settings, tuning
from kernelmux.errors import ConfigurationError
from kernelmux.perf import bench, report, tune
from kernelmux.platforms import detect
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC

CEILINGS = {"memory_gbps": 10.0, "bf16_tflops": 0.5, "fp8_tflops": None, "fp32_tflops": 0.25}
CASES = ["deepseek_v3_t1", "deepseek_v3_t64"]
CPU = detect(torch.device("cpu"))  # the cases run on the CPU, on a GPU machine too


def _plan():
    return bench.Plan(ops=["grouped_topk"], backends=None, cases=CASES, quick=True, baseline=None,
                      flush_l2=False, budget_s=0.01, seed=1, device="cpu")


@pytest.fixture(scope="module")
def run_result():
    engine = Engine(ALL_SPECS, Settings(), platform=CPU)
    return bench.run(_plan(), progress=lambda line: None, engine=engine, ceilings=dict(CEILINGS))


def test_a_run_records_buckets_versions_device_and_selection(run_result):
    env = run_result["environment"]
    assert env["versions"]["torch"] and "kernelmux" in env["versions"]
    assert env["tuning_device"]["kind"] == "cpu" and env["tuning_device"]["units"] == env["threads"]
    kwargs = SPEC.case("deepseek_v3_t64").build()
    assert run_result["buckets"]["grouped_topk/deepseek_v3_t64"] == tuning.bucket(SPEC.validate(**kwargs))
    by_case = {s["case"]: s for s in run_result["selection"]}
    assert set(by_case) == set(CASES)
    for case, choice in by_case.items():
        times = {r["backend"]: r["median_us"] for r in run_result["rows"] if r["case"] == case and "median_us" in r}
        assert choice["chosen"] == "cpu"  # priority order: tuning is off in tests
        assert choice["fastest"] == min(times, key=times.get)
        assert choice["ratio"] == pytest.approx(times["cpu"] / min(times.values()), rel=1e-3)
        assert choice["mismatch"] == (choice["ratio"] > 1.03)


def test_the_selection_line_names_each_slower_choice():
    result = {"selection": [
        {"op": "x", "case": "a", "chosen": "p", "fastest": "p", "chosen_us": 1.0, "fastest_us": 1.0, "ratio": 1.0,
         "mismatch": False},
        {"op": "x", "case": "b", "chosen": "p", "fastest": "q", "chosen_us": 2.0, "fastest_us": 1.0, "ratio": 2.0,
         "mismatch": True},
    ]}
    line = report.selection_line(result)
    assert line.startswith("Selection: on 1 of 2 cases") and "x/b (p 2.0 us, q 1.0 us, 2.00x)" in line
    assert report.selection_line({"rows": []}) == ""


def test_tune_load_writes_a_table_the_engine_orders_calls_by(run_result, tmp_path, monkeypatch, capsys):
    # Rig the run so the reference is fastest on deepseek_v3_t64 and cpu on deepseek_v3_t1 (real
    # times of the two can tie within 3%, where priority decides): the table must route them so.
    rigged = json.loads(json.dumps(run_result))
    for row in rigged["rows"]:
        if "median_us" in row:
            fast = "reference" if row["case"] == "deepseek_v3_t64" else "cpu"
            row["median_us"] = 1.0 if row["backend"] == fast else 50.0
    (tmp_path / "run.json").write_text(json.dumps(rigged))
    monkeypatch.setattr(tuning, "user_dir", lambda: tmp_path / "cache" / "tuning")
    assert cli.main(["tune", "--load", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    (path,) = (tmp_path / "cache" / "tuning").glob("*.json")
    assert str(path) in out and "grouped_topk deepseek_v3_t64: reference 1 us, cpu 50 us" in out
    table = json.loads(path.read_text())
    assert table["schema"] == tuning.SCHEMA and table["device"] == run_result["environment"]["tuning_device"]
    engine = Engine(ALL_SPECS, Settings(), platform=CPU)
    assert engine.tuning.sources == [str(path)]
    dispatcher = engine.dispatchers["grouped_topk"]
    dispatcher(**SPEC.case("deepseek_v3_t64").build())
    dispatcher(**SPEC.case("deepseek_v3_t1").build())
    decided = {key.num_tokens_class: d for key, d in dispatcher.decisions.items()}
    t64 = SPEC.validate(**SPEC.case("deepseek_v3_t64").build()).num_tokens_class
    t1 = SPEC.validate(**SPEC.case("deepseek_v3_t1").build()).num_tokens_class
    assert decided[t64].backend == "reference" and "reference 1 us, cpu 50 us" in decided[t64].tuned
    assert decided[t1].backend == "cpu"
    assert "deepseek_v3_t1 (this bucket): cpu 1 us, reference 50 us" in decided[t1].tuned


def test_a_second_tune_of_other_ops_keeps_the_first_ones_measurements(run_result, tmp_path):
    made = tune.table_of_run(run_result)
    other = {**made, "measurements": [{**m, "op": "other_op"} for m in made["measurements"]]}
    merged = tune.merge(made, other)
    assert {m["op"] for m in merged["measurements"]} == {"grouped_topk", "other_op"}
    replaced = tune.merge(made, {**made, "versions": {"torch": "0"}})
    assert replaced["measurements"] == made["measurements"] and replaced["versions"] == {"torch": "0"}


def test_a_retune_after_the_key_grew_drops_the_ops_older_measurements(run_result):
    made = tune.table_of_run(run_result)
    older = {**made, "measurements": [{**m, "bucket": {k: v for k, v in m["bucket"].items()
                                                       if k != "num_tokens_class"}} for m in made["measurements"]]}
    merged = tune.merge(older, made)
    assert merged["measurements"] == made["measurements"]


def test_a_merge_drops_old_measurements_their_cases_no_longer_fall_in(run_result):
    # Same fields, but a size class no case gives now (a bucket rule moved since), or a case that is gone:
    # neither can order a call, so neither survives a retune of other buckets.
    made = tune.table_of_run(run_result)
    t1, t64 = sorted(made["measurements"], key=lambda m: m["bucket"]["num_tokens_class"])
    moved = {**t1, "bucket": {**t1["bucket"], "num_tokens_class": t1["bucket"]["num_tokens_class"] + 1}}
    gone = {**t1, "case": "no_such_case"}
    assert tune.current(t1) and not tune.current(moved) and not tune.current(gone)
    merged = tune.merge({**made, "measurements": [t1, moved, gone]}, {**made, "measurements": [t64]})
    assert merged["measurements"] == [t1, t64]


def test_a_run_before_tuning_fields_is_refused_by_name(run_result):
    old = {k: v for k, v in run_result.items() if k != "buckets"}
    with pytest.raises(ConfigurationError, match="old.json has no buckets"):
        tune.table_of_run(old, "old.json")


def test_a_simulated_run_measured_no_device(run_result):
    simulated = json.loads(json.dumps(run_result))
    simulated["environment"]["tuning_device"] = None
    with pytest.raises(ConfigurationError, match="simulated platform"):
        tune.table_of_run(simulated)


def test_the_bench_with_a_table_chooses_the_measured_fastest(tmp_path, monkeypatch):
    # The goal's check in miniature: a fake that is slow on purpose has the higher priority; with a
    # table made from a first run, the second run's selection chooses the fast one on every case.
    import time

    def slow_impl(counter):
        impl = fake_impl("slow_fake", counter, priority=99)
        fn = impl.fn

        def sleepy(*args, **kwargs):
            time.sleep(0.002)
            return fn(*args, **kwargs)
        import dataclasses
        import functools
        return dataclasses.replace(impl, fn=functools.wraps(fn)(sleepy))

    registry_plugins = {"slow": FakePlugin(slow_impl(Counter()))}
    monkeypatch.setattr(tuning, "user_dir", lambda: tmp_path / "tuning")
    first = bench.run(_plan(), progress=lambda line: None, ceilings=dict(CEILINGS),
                      engine=Engine(ALL_SPECS, Settings(), platform=CPU, plugins=registry_plugins))
    assert all(s["chosen"] == "slow_fake" and s["mismatch"] for s in first["selection"])
    table = tune.table_of_run(first)
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "t.json").write_text(json.dumps(table))
    second = bench.run(_plan(), progress=lambda line: None, ceilings=dict(CEILINGS),
                       engine=Engine(ALL_SPECS, Settings(), platform=CPU, plugins=registry_plugins))
    # Chosen: an implementation the table ranks as fastest, where those within tuning.TIE of the first
    # run's fastest are tied and keep their priority order (cpu and the reference are often that
    # close, and swap places between runs); the sleeping fake, 2 ms behind, never qualifies.
    for choice in second["selection"]:
        times = {r["backend"]: r["median_us"] for r in first["rows"]
                 if r["case"] == choice["case"] and "median_us" in r}
        assert choice["chosen"] != "slow_fake"
        assert times[choice["chosen"]] <= min(times.values()) * (1 + tuning.TIE), (choice, times)


def test_tune_loads_several_runs_of_one_device_and_refuses_a_mix(run_result, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tuning, "user_dir", lambda: tmp_path / "tuning")
    first = json.loads(json.dumps(run_result))
    first["rows"] = [r for r in first["rows"] if r["case"] == "deepseek_v3_t1"]
    second = json.loads(json.dumps(run_result))
    second["rows"] = [r for r in second["rows"] if r["case"] == "deepseek_v3_t64"]
    other = json.loads(json.dumps(run_result))
    other["environment"]["versions"]["torch"] = "0.0.1"
    for name, run in (("first", first), ("second", second), ("other", other)):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    assert cli.main(["tune", "--load", str(tmp_path / "first.json"), "--load", str(tmp_path / "second.json"),
                     "--out", str(tmp_path / "t.json")]) == 0
    cases = {m["case"] for m in json.loads((tmp_path / "t.json").read_text())["measurements"]}
    assert cases == {"deepseek_v3_t1", "deepseek_v3_t64"}
    capsys.readouterr()
    assert cli.main(["tune", "--load", str(tmp_path / "first.json"), "--load", str(tmp_path / "other.json"),
                     "--out", str(tmp_path / "u.json")]) == 2
    assert "other versions than the runs before it" in capsys.readouterr().err
