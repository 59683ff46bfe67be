"""Warm starts: warmup runs what selection picks for each case, announcing each call before it
starts, records it per device and versions, and info says which first calls are warm."""

from __future__ import annotations

import json

import pytest
import torch

from fakes import Counter, FakePlugin, counting_grouped_topk
from kernelmux import cli
from kernelmux.engine import Engine, Settings, fingerprint, tuning, warm_start as warm
from kernelmux.engine.report import render_report, report
from kernelmux.errors import ConfigurationError, UnknownOpError
from kernelmux.platforms import detect, simulate
from kernelmux.registry import Implementation, JitCache, Registry
from kernelmux.specs import ALL_SPECS
from kernelmux.specs.grouped_topk import SPEC

HERE = detect(torch.device("cpu"))
CASES = ["deepseek_v3_t1", "deepseek_v3_t64"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    # The native fingerprint's build (25 s; tests/engine/test_fingerprint.py builds it) is recorded, not run.
    monkeypatch.setattr(fingerprint, "build_native", lambda log: log("(native fingerprint built)"))
    return tmp_path


def _jitted(backend: str, counter: Counter, priority: int, lines: list[str], cache_dir: str) -> Implementation:
    counting = counting_grouped_topk(counter)

    def grouped_topk(*args, **kwargs):
        counter.seen_before_first_call = counter.seen_before_first_call if counter.calls else list(lines)
        return counting(*args, **kwargs)

    grouped_topk.__signature__ = SPEC.signature
    return Implementation(op=SPEC.name, backend=backend, fn=grouped_topk, spec_version=SPEC.version,
                          priority=priority, jit=JitCache("FakeJIT", lambda: cache_dir, "one kernel per dtype"))


def _engine(*impls) -> Engine:
    registry = Registry({s.name: s for s in ALL_SPECS})
    registry.register_plugin(FakePlugin(*impls), "fakes")
    return Engine(ALL_SPECS, Settings(tuning=False), platform=HERE, registry=registry)


def test_warmup_runs_the_chosen_implementation_announced_before_its_first_call(cache):
    lines: list[str] = []
    chosen, other = Counter(), Counter()
    engine = _engine(_jitted("chosen", chosen, 50, lines, str(cache / "jit")),
                     _jitted("other", other, 40, lines, str(cache / "jit")))
    warmed = warm.warmup(engine, ["grouped_topk"], cases=CASES, log=lines.append)
    assert [(w.op, w.case, w.backend) for w in warmed] == [("grouped_topk", c, "chosen") for c in CASES]
    assert chosen.calls == 2 * len(CASES) and other.calls == 0  # first and again, per case
    assert chosen.seen_before_first_call == [  # the native fingerprint first: the server's process loads it
        "(native fingerprint built)",
        f"warming grouped_topk {CASES[0]}: chosen (may compile: FakeJIT, one kernel per dtype, cached in {cache / 'jit'})"]
    assert all(w.first_s > 0 and w.again_s > 0 and not w.error for w in warmed)
    assert warmed[0].bucket == tuning.bucket(SPEC.validate(**SPEC.case(CASES[0]).build()))


def test_the_record_says_which_first_calls_are_warm(cache):
    engine = _engine(_jitted("chosen", Counter(), 50, [], str(cache / "jit")))
    before = warm.warm_state(engine)
    assert before["ops"]["grouped_topk"] == [{"backend": "chosen", "jit": "FakeJIT", "variant": "one kernel per dtype",
                                             "warmed_buckets": 0}]
    assert "no warm-up record" in before["note"]
    warm.warmup(engine, ["grouped_topk"], cases=CASES)
    after = warm.warm_state(engine)
    assert after["current"] and after["note"] == ""
    assert after["ops"]["grouped_topk"][0]["warmed_buckets"] == len(CASES)  # t1 and t64: two buckets
    warm.warmup(engine, ["grouped_topk"], cases=CASES[:1])  # again: merged, not duplicated
    assert warm.warm_state(engine)["ops"]["grouped_topk"][0]["warmed_buckets"] == len(CASES)
    text = _rendered(engine)
    assert "FakeJIT: one kernel per dtype" in text and "warm-up record" in text


def test_a_record_of_other_versions_warms_nothing(cache):
    engine = _engine(_jitted("chosen", Counter(), 50, [], str(cache / "jit")))
    warm.warmup(engine, ["grouped_topk"], cases=CASES)
    path = warm.record_path(engine)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(data, versions=dict(data["versions"], torch="1.0"))))
    state = warm.warm_state(engine)
    assert not state["current"] and "other versions" in state["note"]
    assert state["ops"]["grouped_topk"][0]["warmed_buckets"] == 0
    assert "none: the first call compiles" in _rendered(engine)


def test_the_caches_are_listed_with_what_they_hold(cache):
    jit = cache / "jit"
    (jit / "sub").mkdir(parents=True)
    (jit / "sub" / "kernel.bin").write_bytes(b"x" * 1000)
    engine = _engine(_jitted("chosen", Counter(), 50, [], str(jit)))
    (listed,) = warm.jit_caches(engine, usage=True)
    assert listed == {"name": "FakeJIT", "directory": str(jit), "backends": ["chosen"], "exists": True,
                      "files": 1, "bytes": 1000}
    # Without usage (every kernelmux.report()), the directory is not walked.
    assert warm.jit_caches(engine) == [{"name": "FakeJIT", "directory": str(jit), "backends": ["chosen"],
                                        "exists": True}]


def test_a_failing_call_is_reported_and_not_recorded(cache):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image")

    broken.__signature__ = SPEC.signature
    engine = _engine(Implementation(op=SPEC.name, backend="broken", fn=broken, spec_version=SPEC.version,
                                    priority=50))
    (failed,) = warm.warmup(engine, ["grouped_topk"], cases=CASES[:1])
    assert "no kernel image" in failed.error
    assert not warm.record_path(engine).exists()


def test_simulated_platforms_and_unknown_ops_are_refused():
    simulated = Engine(ALL_SPECS, Settings(tuning=False), platform=simulate("sm_90"))
    with pytest.raises(ConfigurationError, match="simulated"):
        warm.warmup(simulated, ["grouped_topk"])
    assert warm.warm_state(simulated)["note"].startswith("a simulated platform")
    with pytest.raises(UnknownOpError):
        warm.warmup(_engine(), ["nope"])


def test_every_built_in_backend_that_compiles_declares_its_cache():
    from kernelmux.backends import aiter, cuda, deepgemm, flashinfer

    for module in (aiter, cuda, deepgemm, flashinfer):
        records = [r for r in module.kernelmux_implementations() if not r.description.startswith("none: ")]  # Gaps
        assert records and all(r.jit is not None and r.jit.directory() for r in records), module.__name__


def test_the_command_warms_and_records(cache, capsys):
    out = cache / "warmed.json"
    assert cli.main(["warmup", "grouped_topk", "--case", CASES[0], "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"warming grouped_topk {CASES[0]}" in text and "warmed 1 call(s) of 1 op(s)" in text
    (entry,) = json.loads(out.read_text())
    assert entry["op"] == "grouped_topk" and entry["case"] == CASES[0] and entry["first_s"] > 0
    assert cli.main(["warmup", "grouped_topk", "--tuned"]) == 2  # tuning is off in tests: no table


def _rendered(engine: Engine) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_report(report(engine)))
    return console.export_text()


def test_kernelmux_warmup_goes_through_the_current_engine(cache):
    import kernelmux

    (warmed,) = kernelmux.warmup(["grouped_topk"], cases=CASES[:1])
    device = kernelmux.current().platform.device  # where warmup built the case (a GPU's key differs from cpu's)
    assert warmed.backend == kernelmux.current().dispatchers["grouped_topk"].decisions[
        SPEC.validate(**SPEC.case(CASES[0]).build(device))].backend
