"""The aiter backend as the engine meets it: selected on a simulated gfx942 and gfx950 for every op it
covers (above triton), a reason for the others, and quarantined with version and reason when amd-aiter
is missing, outside the tested range, raising at import or missing a keyword (that op only)."""

from __future__ import annotations

import logging

import pytest
import torch

from kernelmux.backends import _vendor
from kernelmux.backends._table import Gap
from kernelmux.backends.aiter import AITER, CALLS, QUANTIZE_FP8_REASON, QUANTIZE_MXFP4_REASON, TABLE
from kernelmux.backends.aiter import grouped_topk as grouped_topk_adapter
from kernelmux.engine import Engine, Settings
from kernelmux.specs import ALL_SPECS
from vendors import sources

COVERED = {
    "gfx942": {"grouped_topk", "fused_moe", "paged_attention", "mla_decode", "scaled_mm"},
    "gfx950": {"grouped_topk", "fused_moe", "paged_attention", "mla_decode", "scaled_mm", "fp4_mm"},
}
# The ops aiter has no kernel for (its TABLE's Gap rows), on either arch.
GAPS = {gap.op: f"no kernel for {gap.op}: {gap.reason}" for gap in TABLE if isinstance(gap, Gap)}
DECLINED = {
    "gfx942": {"quantize_fp8": QUANTIZE_FP8_REASON, "fp4_mm": "needs arch in {gfx950}, this is gfx942",
               "quantize_mxfp4": "needs arch in {gfx950}, this is gfx942", **GAPS},
    "gfx950": {"quantize_fp8": QUANTIZE_FP8_REASON, "quantize_mxfp4": QUANTIZE_MXFP4_REASON, **GAPS},
}


def _aiter_rows(engine):
    """op -> ("chosen" | "viable" | the startup reason) for aiter's implementation of each op."""
    rows = {}
    for op, table in engine.tables.items():
        for position, candidate in enumerate(table.candidates):
            if candidate.impl.backend == "aiter":
                rows[op] = "chosen" if position == 0 else "viable"
        rows.update({op: why for impl, why in table.rejected if impl.backend == "aiter"})
    return rows


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_selected_for_every_op_it_covers_and_a_reason_for_the_others(install_aiter, arch):
    install_aiter(arch)
    rows = _aiter_rows(Engine(ALL_SPECS, Settings(platform=arch)))
    assert {op for op, state in rows.items() if state == "chosen"} == COVERED[arch]
    assert {op: state for op, state in rows.items() if state != "chosen"} == DECLINED[arch]
    assert set(rows) == {entry.op for entry in TABLE}


def test_above_the_triton_backend_and_named_with_its_version(gfx942):
    engine = Engine(ALL_SPECS, Settings(platform="gfx942"))
    backends = [c.impl.backend for c in engine.tables["paged_attention"].candidates]
    assert backends.index("aiter") < backends.index("triton")
    [impl] = [c.impl for c in engine.tables["mla_decode"].candidates if c.impl.backend == "aiter"]
    assert impl.description.startswith("amd-aiter 0.1.21.dev46+ge4048607a: dry-run only")
    assert impl.devices == frozenset({"cuda"}) and engine.distribution("aiter").startswith("kernelmux ")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_not_installed_rejects_every_implementation(monkeypatch, arch):
    monkeypatch.setattr(_vendor, "_problems", {})
    real = type(AITER).version
    monkeypatch.setattr(type(AITER), "version", lambda self: None if self is AITER else real(self))
    rows = _aiter_rows(Engine(ALL_SPECS, Settings(platform=arch)))
    gated = {op for op, why in DECLINED[arch].items() if why.startswith("needs arch")} | set(GAPS)
    assert {op: why for op, why in rows.items() if op not in gated} == {
        entry.op: "amd-aiter is not installed (pip install 'kernelmux[aiter]')" for entry in TABLE
        if entry.op not in gated}


@pytest.mark.parametrize("version, files, reason", [
    ("0.1.21.dev46+ge4048607a", {"aiter/__init__.py": "raise RuntimeError('ROCm version file not found')\n"},
     "amd-aiter 0.1.21.dev46+ge4048607a: import aiter failed: RuntimeError: ROCm version file not found"),
    ("0.1.7.post2.dev18", None,  # PyPI's only upload
     "amd-aiter 0.1.7.post2.dev18 is outside the tested range >=0.1.20,<0.1.22 (pip install 'kernelmux[aiter]')"),
    ("0.1.22", None, "amd-aiter 0.1.22 is outside the tested range >=0.1.20,<0.1.22"),
])
def test_a_broken_vendor_is_quarantined_with_its_version_and_reason(install_aiter, version, files, reason):
    install_aiter("gfx950", version=version, files=files)
    rows = _aiter_rows(Engine(ALL_SPECS, Settings(platform="gfx950")))
    assert all(reason in why for op, why in rows.items() if op not in GAPS), rows


def test_a_missing_keyword_rejects_only_the_op_that_passes_it(install_aiter):
    fake = sources("aiter")
    path = "aiter/fused_moe.py"
    install_aiter("gfx942", files={**fake, path: fake[path].replace("    topk_weight,\n", "    topk_weights,\n", 1)
                                   .replace("topk_weight[token, slot]", "topk_weights[token, slot]")
                                   .replace("topk_weight.dtype", "topk_weights.dtype")
                                   .replace("topk_weight.shape", "topk_weights.shape")
                                   .replace("topk_weight.is_contiguous", "topk_weights.is_contiguous")})
    assert "aiter.fused_moe.fused_moe takes no keyword topk_weight" in AITER.problem_for(CALLS["fused_moe"])
    rows = _aiter_rows(Engine(ALL_SPECS, Settings(platform="gfx942")))
    assert "takes no keyword topk_weight" in rows["fused_moe"] and rows["grouped_topk"] == "chosen"


def test_the_first_call_is_logged_before_it_runs_and_timed(gfx942, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(grouped_topk_adapter, "first_calls", _vendor.first_calls)
    kwargs = dict(gating_output=torch.randn(3, 64), topk=4, renormalize=True, num_expert_group=8, topk_group=2,
                  scoring_func="sigmoid", routed_scaling_factor=1.0, e_score_correction_bias=torch.zeros(64))
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        grouped_topk_adapter.grouped_topk(**kwargs)
        grouped_topk_adapter.grouped_topk(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "may compile the vendor's kernel (JIT with hipcc" in messages[0]
    assert "took" in messages[1]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_info_and_explain_on_the_simulated_arch(install_aiter, arch):
    # What `kernelmux info --platform <arch>` and `kernelmux explain <op> --platform <arch>` print.
    from kernelmux.engine.report import explain_report, report

    install_aiter(arch)
    engine = Engine(ALL_SPECS, Settings(platform=arch))
    chosen = {entry["op"]: entry["chosen"] for entry in report(engine)["ops"]}
    assert {op for op, backend in chosen.items() if backend == "aiter"} == COVERED[arch]
    for op, reason in DECLINED[arch].items():
        explained = explain_report(engine, op, None, None)
        assert {"backend": "aiter", "reason": reason}.items() <= next(
            r for r in explained["rejected"] if r["backend"] == "aiter").items()
