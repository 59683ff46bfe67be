"""The conformance kit finds the defects a deliberately broken plugin has (wrong values, wrong dtype,
ignored strides, breaking under graph replay) and passes built-in backends; the command line and the
pytest fixture report the same."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json

import pytest
import torch

from kernelmux import cli
from kernelmux.conformance import CASE_CHECKS, DECLINED, FAIL, PASS, SKIPPED, check
from kernelmux.conformance.pytest_plugin import assert_conforms
from kernelmux.errors import ConfigurationError
from kernelmux.registry import Implementation, hookimpl
from kernelmux.specs import grouped_topk as spec_module

SPEC = spec_module.SPEC
CASES = ["deepseek_v3_t1", "deepseek_v3_t64", "small_sigmoid_bias", "empty"]
ON_GPU = torch.cuda.is_available()


def _impl(backend: str, body) -> Implementation:
    def grouped_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int,
                     topk_group: int, scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                     e_score_correction_bias=None):
        return body(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                    routed_scaling_factor, e_score_correction_bias)

    grouped_topk.__annotations__ = dict(spec_module.grouped_topk.__annotations__)
    return Implementation(op="grouped_topk", backend=backend, fn=grouped_topk, spec_version=SPEC.version)


def _doubled(*args):
    weights, ids = SPEC.reference(*args)
    return weights * 2, ids


def _int64_ids(*args):
    weights, ids = SPEC.reference(*args)
    return weights, ids.long()


def _assumes_contiguous(logits, *rest):
    # Reads the logits as if rows were dense: right for contiguous inputs only.
    dense = torch.as_strided(logits, logits.shape, (logits.shape[1], 1))
    return SPEC.reference(dense, *rest)


def _wrong_on_softmax(logits, topk, renormalize, groups, topk_group, scoring_func, *rest):
    # Right on sigmoid scores, those of every named case the tests run here.
    weights, ids = SPEC.reference(logits, topk, renormalize, groups, topk_group, scoring_func, *rest)
    return (weights * 2 if scoring_func == "softmax" else weights), ids


def _on_the_host(logits, *rest):
    # A host round trip: fine eagerly, refused by CUDA-graph capture.
    weights, ids = SPEC.reference(logits.cpu(), *(r.cpu() if isinstance(r, torch.Tensor) else r for r in rest))
    return weights.to(logits.device), ids.to(logits.device)


class _Broken:
    @hookimpl
    def kernelmux_implementations(self):
        return [_impl("good", SPEC.reference), _impl("wrong_values", _doubled), _impl("wrong_dtype", _int64_ids),
                _impl("ignores_strides", _assumes_contiguous), _impl("host_bound", _on_the_host),
                _impl("wrong_on_softmax", _wrong_on_softmax),
                # The same host round trip, declared: capture_check names it, so the engine never captures it.
                dataclasses.replace(_impl("host_bound_declared", _on_the_host),
                                    capture_check=lambda key, platform: "copies the logits to the host")]


PLUGINS = {"broken_for_the_kit": _Broken()}


def _kit(backend: str, **options):
    cases = [c.name for c in SPEC.cases if c.name in CASES or c.name.startswith("empty")]
    return check(backend, ["grouped_topk"], cases=cases, plugins=PLUGINS, seed=5, **options)


def _statuses(report, check_name):
    return {f.case: f.status for f in report.findings if f.check == check_name}


def test_a_correct_plugin_passes_every_check_that_runs_here():
    report = _kit("good")
    assert report.failures == [] and report.counts()[PASS] >= 3 * len(CASES)
    graph = _statuses(report, "graph")
    assert set(graph.values()) == ({PASS} if ON_GPU else {SKIPPED})
    assert {f.check for f in report.findings if f.status == PASS} >= {"reference", "fake", "strided", "compile",
                                                                       "opcheck"}


def test_wrong_values_fail_the_reference_check_on_every_case():
    report = _kit("wrong_values")
    failed = {f.case for f in report.failures if f.check == "reference"}
    nonempty = {f.case for f in report.findings if f.check == "reference"} - {
        c.name for c in SPEC.cases if c.name.startswith("empty")}
    assert nonempty and nonempty <= failed
    assert "weights" in report.failures[0].message


def test_a_wrong_dtype_fails():
    report = _kit("wrong_dtype")
    assert report.failures and all("int64" in f.message or "dtype" in f.message for f in report.failures)


def test_ignored_strides_pass_contiguous_inputs_and_fail_strided_ones():
    report = _kit("ignores_strides")
    assert set(_statuses(report, "reference").values()) == {PASS}
    strided = _statuses(report, "strided")
    assert FAIL in strided.values() and all(f.check == "strided" for f in report.failures)


@pytest.mark.skipif(not ON_GPU, reason="CUDA-graph replay needs a CUDA device; the CPU run skips the graph check")
def test_a_host_round_trip_fails_graph_replay_only():
    report = _kit("host_bound")
    assert report.failures and {f.check for f in report.failures} == {"graph"}


def test_a_declared_host_round_trip_is_declined_by_the_graph_check_not_failed():
    report = _kit("host_bound_declared")
    assert report.failures == []
    graph = [f for f in report.findings if f.check == "graph"]
    assert graph and all(f.status == DECLINED and "cannot be captured: copies the logits to the host" in f.message
                         for f in graph)


def test_unknown_names_are_configuration_errors():
    with pytest.raises(ConfigurationError, match="no backend 'nope'"):
        check("nope", plugins=PLUGINS)
    with pytest.raises(ConfigurationError, match="unknown op"):
        check("good", ["nope"], plugins=PLUGINS)


def test_the_caller_engine_survives_the_op_checks():
    import kernelmux.engine as engine_module

    before = engine_module.current()
    _kit("good", checks=("reference", "compile"))
    assert engine_module.current() is before


def test_the_built_in_cpu_backend_conforms():
    report = check("cpu", ["grouped_topk"], seed=11, checks=CASE_CHECKS)
    assert report.failures == [] and report.counts()[PASS] > 10


def test_the_fixture_comes_from_the_pytest11_entry_point(request):
    points = importlib.metadata.entry_points(group="pytest11")
    assert any(p.value == "kernelmux.conformance.pytest_plugin" for p in points)
    assert request.getfixturevalue("kernelmux_conformance") is assert_conforms
    with pytest.raises(AssertionError, match="grouped_topk / .* / reference"):
        assert_conforms("wrong_values", ["grouped_topk"], cases=["deepseek_v3_t64"], plugins=PLUGINS,
                        checks=("reference",))


def test_the_command_exits_0_when_clean_and_writes_every_finding(tmp_path, capsys):
    out = tmp_path / "found.json"
    code = cli.main(["check", "--backend", "cpu", "grouped_topk", "--case", "deepseek_v3_t64", "--seed", "2",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "kernelmux check --backend cpu on cpu" in text and "fail" not in text
    found = json.loads(out.read_text())
    assert {f["check"] for f in found["findings"]} >= {"reference", "fake", "strided"}
    assert cli.main(["check", "--backend", "nope"]) == 2


def test_a_supports_that_raises_is_a_failure_not_a_crash():
    def raising(key, platform):
        raise RuntimeError("probe failed")

    class _Raising:
        @hookimpl
        def kernelmux_implementations(self):
            impl = _impl("raising_supports", SPEC.reference)
            return [Implementation(op=impl.op, backend=impl.backend, fn=impl.fn, spec_version=impl.spec_version,
                                   supports=raising)]

    report = check("raising_supports", ["grouped_topk"], cases=["deepseek_v3_t1"], plugins={"r": _Raising()},
                   checks=("reference",))
    (failure,) = report.failures
    assert "supports() raised RuntimeError: probe failed" in failure.message


def test_drawn_shapes_find_a_defect_the_named_cases_miss_and_shrink_it():
    report = _kit("wrong_on_softmax", checks=("reference", "drawn"))
    assert set(_statuses(report, "reference").values()) == {PASS}
    (failure,) = report.failures
    assert failure.check == "drawn" and failure.case.startswith("drawn: ") and "softmax" in failure.case
    # Shrunk: hypothesis reports the smallest failing draw, here one token.
    assert "T 1," in failure.case and "weights" in failure.message


def test_drawn_shapes_pass_a_correct_plugin_and_skip_a_spec_without_a_strategy(monkeypatch):
    (drawn,) = [f for f in _kit("good", checks=("drawn",)).findings]
    assert drawn.status == PASS and drawn.message.startswith("20 drawn shapes agreed")
    monkeypatch.setitem(vars(SPEC), "shapes", None)  # every built-in spec draws shapes: a plugin's might not
    (skipped,) = _kit("good", checks=("drawn",)).findings
    assert skipped.status == SKIPPED and "no OpSpec.shapes" in skipped.message


def test_a_non_positive_example_count_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="examples: expected a positive int"):
        check("good", ["grouped_topk"], plugins=PLUGINS, checks=("drawn",), examples=0)
