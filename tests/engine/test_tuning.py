"""Tuning tables: buckets, nearest-class lookup, the device and version checks, and the engine trying
candidates in the measured order (the reference where it ranked first), behind user preference."""

from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path

import pytest
import torch

from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import Engine, FallbackWarning, Settings, tuning
from kernelmux.engine.report import explain_report, report
from kernelmux.errors import ConfigurationError
from kernelmux.perf import tune
from kernelmux.platforms import detect, simulate
from kernelmux.registry import Registry
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC

HERE = detect(torch.device("cpu"))  # real (a simulated one has no measurements), of the CPU the cases are on
CASE = "small_sigmoid_bias"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Tuning on, the shipped tables hidden, the user's in tmp_path/tuning; returns a writer."""
    monkeypatch.setattr(tuning, "shipped_dir", lambda: tmp_path / "shipped")
    monkeypatch.setattr(tuning, "user_dir", lambda: tmp_path / "tuning")
    (tmp_path / "tuning").mkdir()

    def write(times_by_case: dict[str, dict[str, float]], name: str = "t.json", registry=None, **changes):
        registry = registry or _registry()
        buckets = {}
        rows = []
        for case, times in times_by_case.items():
            buckets["grouped_topk", case] = tuning.bucket(SPEC.validate(**SPEC.case(case).build()))
            rows += [{"op": "grouped_topk", "case": case, "backend": b, "status": "ok", "median_us": t}
                     for b, t in times.items()]
        table = tuning.make_table(rows, buckets, tuning.device_identity(HERE), tuning.versions(registry), "abc")
        table.update(changes)
        path = tmp_path / "tuning" / name
        path.write_text(json.dumps(table))
        return path

    return write


def _registry(*impls) -> Registry:
    registry = Registry({s.name: s for s in ALL_SPECS})
    registry.register_plugin(FakePlugin(*impls), "fakes")
    return registry


def _engine(*impls, settings=Settings()) -> Engine:
    return Engine(ALL_SPECS, settings, platform=HERE, registry=_registry(*impls))


def _decide(engine: Engine, case: str = CASE):
    kwargs = SPEC.case(case).build()
    engine.dispatchers["grouped_topk"](**kwargs)
    (decision,) = engine.dispatchers["grouped_topk"].decisions.values()
    return decision


def test_the_bucket_is_the_key_without_its_device_and_layouts_only_as_presence():
    key = SPEC.validate(**SPEC.case(CASE).build())
    bucket = tuning.bucket(key)
    assert "device" not in bucket
    assert bucket["logits_dtype"] == str(key.logits_dtype).removeprefix("torch.")
    assert bucket["num_tokens_class"] == key.num_tokens_class
    assert bucket["gating_output_layout"] == "present"
    assert bucket["e_score_correction_bias_layout"] == "present"
    assert json.loads(json.dumps(bucket)) == bucket


def test_measured_order_beats_priority(tables):
    a, b = Counter(), Counter()
    registry = _registry(fake_impl("fast", a, priority=1), fake_impl("slow", b, priority=9))
    tables({CASE: {"fast": 10.0, "slow": 30.0, "reference": 50.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    decision = _decide(engine)
    assert decision.backend == "fast" and a.calls == 1 and b.calls == 0
    assert "fast 10 us, slow 30 us, reference 50 us" in decision.tuned and "this bucket" in decision.tuned
    assert [b for b, _ in decision.answers] == ["fast", "slow", "reference"]


def test_the_reference_runs_where_it_measured_fastest_without_a_fallback_warning(tables):
    slow = Counter()
    registry = _registry(fake_impl("slow", slow, priority=9))
    tables({CASE: {"slow": 80.0, "reference": 20.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(strict=True), platform=HERE, registry=registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        decision = _decide(engine)
    assert decision.backend == "reference" and not decision.fallback and slow.calls == 0
    assert "reference 20 us, slow 80 us" in decision.tuned


def test_a_declining_first_choice_passes_to_the_next_measured(tables):
    a, b = Counter(), Counter()
    registry = _registry(fake_impl("fast", a, decline=lambda key: "not this one"), fake_impl("other", b))
    tables({CASE: {"fast": 1.0, "other": 5.0, "reference": 9.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert _decide(engine).backend == "other" and b.calls == 1


def test_user_preference_beats_the_table(tables):
    a, b = Counter(), Counter()
    registry = _registry(fake_impl("fast", a), fake_impl("slow", b))
    tables({CASE: {"fast": 1.0, "slow": 5.0, "reference": 9.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(prefer={"grouped_topk": ("slow",)}), platform=HERE, registry=registry)
    assert _decide(engine).backend == "slow"


def test_unmeasured_implementations_follow_the_measured_ones_by_priority(tables):
    a, b, c = Counter(), Counter(), Counter()
    registry = _registry(fake_impl("measured", a, priority=1), fake_impl("new_hi", b, priority=9),
                         fake_impl("new_lo", c, priority=5))
    tables({CASE: {"measured": 3.0, "reference": 9.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert [b for b, _ in _decide(engine).answers] == ["measured", "reference", "new_hi", "new_lo"]


def test_the_nearest_size_class_serves_an_unmeasured_batch(tables):
    registry = _registry(fake_impl("fast", Counter()), fake_impl("slow", Counter()))
    # small_sigmoid_bias has a handful of tokens; a table that measured a larger and a much larger
    # class of the same shape is used through the nearer one.
    kwargs = SPEC.case(CASE).build()
    key = SPEC.validate(**kwargs)
    near, far = tuning.bucket(key), tuning.bucket(key)
    near["num_tokens_class"] = 2 * key.num_tokens_class + 1
    far["num_tokens_class"] = 1024 * (key.num_tokens_class + 1) - 1
    identity, installed = tuning.device_identity(HERE), tuning.versions(registry)
    table = {"schema": tuning.SCHEMA, "device": identity, "versions": installed, "measurements": [
        {"op": "grouped_topk", "case": "near", "bucket": near, "times_us": {"slow": 1.0, "fast": 2.0}},
        {"op": "grouped_topk", "case": "far", "bucket": far, "times_us": {"fast": 1.0, "slow": 2.0}},
    ]}
    path = tables({}, name="empty.json")
    path.write_text(json.dumps(table))
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    decision = _decide(engine)
    assert decision.backend == "slow" and "case near (the nearest measured batch-size class)" in decision.tuned


def test_a_measurement_of_an_older_key_orders_nothing(tables):
    # A table measured before the op's key grew a size class: its bucket cannot be matched to the new
    # key's, so priorities order the call (no KeyError, no nearest class made up).
    registry = _registry(fake_impl("fast", Counter(), priority=1), fake_impl("slow", Counter(), priority=9))
    old = tuning.bucket(SPEC.validate(**SPEC.case(CASE).build()))
    del old["num_tokens_class"]
    identity, installed = tuning.device_identity(HERE), tuning.versions(registry)
    path = tables({}, name="old.json", registry=registry)
    path.write_text(json.dumps({"schema": tuning.SCHEMA, "device": identity, "versions": installed, "measurements": [
        {"op": "grouped_topk", "case": CASE, "bucket": old, "times_us": {"fast": 1.0, "slow": 5.0}}]}))
    decision = _decide(Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry))
    assert decision.backend == "slow" and decision.tuned == ""


def test_attention_buckets_keep_contexts_apart():
    # 70B-TP8 B8 at 4096 and 32768 tokens of context: one batch class, opposite winners on an H100.
    from kernelmux.specs.mla_decode import SPEC as MLA
    from kernelmux.specs.paged_attention import SPEC as PAGED

    for spec in (PAGED, MLA):
        short, long = (next(c for c in spec.cases if "ctx" not in c.name and "random" in c.tags).build()
                       for _ in range(2))
        long["max_seq_len"] = 8 * short["max_seq_len"] + 8
        a, b = tuning.bucket(spec.validate(**short)), tuning.bucket(spec.validate(**long))
        assert a["max_seq_len_class"] < b["max_seq_len_class"]
        assert {k: v for k, v in a.items() if k != "max_seq_len_class"} == \
            {k: v for k, v in b.items() if k != "max_seq_len_class"}


def test_another_shape_is_not_ordered_by_the_table(tables):
    registry = _registry(fake_impl("fast", Counter(), priority=1), fake_impl("slow", Counter(), priority=9))
    tables({"small_softmax": {"fast": 1.0, "slow": 5.0, "reference": 9.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    decision = _decide(engine)  # small_sigmoid_bias: another scoring function, another bucket
    assert decision.backend == "slow" and decision.tuned == ""


def test_a_table_of_other_versions_is_ignored_with_a_note(tables):
    registry = _registry(fake_impl("fast", Counter(), priority=1), fake_impl("slow", Counter(), priority=9))
    installed = tuning.versions(registry)
    path = tables({CASE: {"fast": 1.0, "slow": 5.0, "reference": 9.0}}, registry=registry,
                  versions={**installed, "torch": "1.0.0", "flashinfer-python": "0.0.1"})
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert _decide(engine).backend == "slow"
    (note,) = engine.tuning.notes
    assert str(path) in note and "torch 1.0.0 measured, " + torch.__version__ + " installed" in note
    assert "flashinfer-python 0.0.1 measured" in note
    assert report(engine)["tuning"]["notes"] == [note]


def test_another_devices_table_is_not_loaded(tables):
    registry = _registry(fake_impl("fast", Counter(), priority=1), fake_impl("slow", Counter(), priority=9))
    identity = dict(tuning.device_identity(HERE), units=10_000)
    tables({CASE: {"fast": 1.0, "slow": 5.0, "reference": 9.0}}, registry=registry, device=identity)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert engine.tuning.sources == [] and engine.tuning.notes == []
    assert _decide(engine).backend == "slow"


def test_an_unreadable_table_is_a_note_not_an_error(tables, tmp_path):
    (tmp_path / "tuning" / "broken.json").write_text("{not json")
    (tmp_path / "tuning" / "old.json").write_text(json.dumps({"schema": "kernelmux.tuning/0"}))
    engine = _engine()
    assert len(engine.tuning.notes) == 2 and all("unreadable" in n for n in engine.tuning.notes)


def test_tuning_off_and_simulated_platforms_load_nothing(tables, monkeypatch):
    registry = _registry(fake_impl("fast", Counter()))
    tables({CASE: {"fast": 1.0, "reference": 9.0}}, registry=registry)
    assert Engine(ALL_SPECS, Settings(), platform=simulate("x86_64"), registry=registry).tuning.sources == []
    assert Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry).tuning.sources
    for env in ({"KERNELMUX_TUNING": "0"}, {"KERNELMUX_TUNING": "off"}):
        engine = Engine(ALL_SPECS, Settings.from_env(env), platform=HERE, registry=registry)
        assert engine.tuning.sources == [] and "tuning tables off" in engine.tuning.notes[0]
    assert Settings.from_env({}).tuning and Settings.from_env({"KERNELMUX_TUNING": "1"}).tuning
    with pytest.raises(ConfigurationError, match="KERNELMUX_TUNING='sometimes'"):
        Settings.from_env({"KERNELMUX_TUNING": "sometimes"})


def test_a_user_table_replaces_a_shipped_measurement_of_the_same_bucket(tables, tmp_path):
    registry = _registry(fake_impl("a", Counter()), fake_impl("b", Counter()))
    shipped = tables({CASE: {"a": 1.0, "b": 5.0}}, name="shipped.json", registry=registry)
    (tmp_path / "shipped").mkdir()
    shipped.rename(tmp_path / "shipped" / "t.json")
    tables({CASE: {"a": 5.0, "b": 1.0}}, name="user.json", registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert len(engine.tuning.sources) == 2 and _decide(engine).backend == "b"


def test_cases_sharing_a_bucket_are_one_measurement_at_the_geometric_mean():
    bucket = {"n": 1}
    rows = [{"op": "x", "case": c, "backend": b, "status": "ok", "median_us": t}
            for c, b, t in (("c1", "a", 1.0), ("c1", "b", 4.0), ("c2", "a", 16.0), ("c2", "b", 4.0),
                            ("c2", "only_here", 1.0), ("c3", "a", 1.0))]
    rows.append({"op": "x", "case": "c1", "backend": "broken", "status": "wrong"})
    table = tuning.make_table(rows, {("x", "c1"): bucket, ("x", "c2"): bucket, ("x", "c3"): {"n": 2}}, {}, {})
    (m,) = table["measurements"]  # c3 timed one backend only: nothing to rank
    assert m["case"] == "c1, c2" and m["times_us"] == {"a": 4.0, "b": 4.0}


def test_explain_says_which_table_and_measurement_ordered_the_call(tables):
    registry = _registry(fake_impl("fast", Counter()))
    path = tables({CASE: {"fast": 2.0, "reference": 9.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    data = explain_report(engine, "grouped_topk", SPEC.case(CASE).build(), CASE)
    assert data["chosen"] == "fast" and path.name in data["tuned"] and data["tuning"]["tables"] == [str(path)]


def test_every_vendor_the_backends_declare_is_in_the_fingerprint():
    root = Path(__file__).resolve().parents[2] / "backends"
    declared = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Vendor":
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                args += [k.value.value for k in node.keywords if k.arg == "distribution"]
                declared.add(args[1] if len(args) > 1 else args[0])
    assert declared and declared <= set(tuning.VENDOR_DISTRIBUTIONS), declared - set(tuning.VENDOR_DISTRIBUTIONS)


def test_explain_renders_a_reference_ranked_first(tables):
    from rich.console import Console

    registry = _registry(fake_impl("slow", Counter()))
    tables({CASE: {"slow": 9.0, "reference": 2.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    from kernelmux.engine.report import render_explain

    console = Console(width=200, record=True)
    console.print(render_explain(explain_report(engine, "grouped_topk", SPEC.case(CASE).build(), CASE)))
    text = console.export_text()
    assert "chosen: reference" in text and "ordered by: tuning table t.json" in text
    assert text.index("ranked by the tuning table") < text.index("│ slow")


def test_times_within_the_tie_keep_priority_order_and_the_reference_last(tables):
    registry = _registry(fake_impl("hi", Counter(), priority=9), fake_impl("lo", Counter(), priority=1))
    # The reference 2.5% faster than hi, lo between them: all within the tie, priority decides.
    tables({CASE: {"hi": 9.95, "lo": 9.8, "reference": 9.7}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert [b for b, _ in _decide(engine).answers] == ["hi", "lo", "reference"]


def test_beyond_the_tie_the_faster_one_leads(tables):
    registry = _registry(fake_impl("hi", Counter(), priority=9), fake_impl("lo", Counter(), priority=1))
    tables({CASE: {"hi": 10.0, "lo": 9.0, "reference": 30.0}}, registry=registry)
    engine = Engine(ALL_SPECS, Settings(), platform=HERE, registry=registry)
    assert [b for b, _ in _decide(engine).answers] == ["lo", "hi", "reference"]


def test_every_shipped_bucket_names_its_ops_current_key_fields():
    # A bucket is matched on all of its key's fields: a field added to an op's key (fused_moe's global
    # scales, spec version 2) must be added to the shipped buckets too, or they silently stop matching.
    fields = {spec.name: set(spec.key._fields) - {"device"} for spec in ALL_SPECS}
    shipped = sorted((Path(tuning.__file__).parent / "tables").glob("*.json"))  # conftest hides shipped_dir()
    assert shipped
    for path in shipped:
        for measurement in json.loads(path.read_text())["measurements"]:
            assert set(measurement["bucket"]) == fields[measurement["op"]], (path.name, measurement["case"])


@pytest.mark.parametrize("path", sorted(tuning.shipped_dir().glob("*.json")), ids=lambda path: path.stem)
def test_every_shipped_measurement_is_the_bucket_of_its_cases(path):
    # A measurement whose bucket no longer comes out of its cases' keys (the key or bucket changed since it was
    # measured) can never order a call: re-measure or drop it, do not ship it (kernelmux tune's merge drops it).
    orphans = [f"{m['op']} / {m['case']}" for m in json.loads(path.read_text())["measurements"]
               if not tune.current(m)]
    assert not orphans, f"{len(orphans)} measurements match no bucket of their cases: {orphans[:5]}"
