"""The flashinfer backend's grouped_topk against a fake flashinfer that holds the shipped signature,
checks and layouts (tests/vendors/flashinfer): the adapter's results against the spec's reference, its
declines, keyword calls, and the vendor mechanism's quarantine and first-call log. On a GPU with
flashinfer installed, tests/backends/test_conformance.py runs the real one against the reference."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER
from kernelmux.backends.flashinfer import grouped_topk as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import detect, simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import grouped_topk as spec
from vendors import install_fake, sources


def _install(monkeypatch, tmp_path, version="0.6.14", files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", version, files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    return sys.modules.get("flashinfer.fused_moe") or __import__("flashinfer.fused_moe").fused_moe


def _routing(tokens, experts, groups, topk_group, topk, seed, strided=False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts * (2 if strided else 1), generator=generator)
    return dict(gating_output=logits[:, ::2] if strided else logits, topk=topk, renormalize=True,
                num_expert_group=groups, topk_group=topk_group, scoring_func="sigmoid",
                routed_scaling_factor=2.5, e_score_correction_bias=torch.randn(experts, generator=generator) * 0.1)


@pytest.mark.parametrize("tokens, experts, groups, topk_group, topk, strided", [
    (33, 256, 8, 4, 8, False),  # DeepSeek-V3
    (5, 160, 8, 3, 6, False),   # DeepSeek-V2-like, 20 experts a group (declined on a GPU: not confirmed)
    (7, 64, 1, 1, 1, True),     # one group; a column-strided logits view the adapter makes contiguous
    (0, 256, 8, 4, 8, False),   # an empty batch never reaches the vendor
])
def test_adapter_matches_the_reference(vendor, tokens, experts, groups, topk_group, topk, strided):
    # The adapter's arguments and layouts on shapes beyond the confirmed ones too: the fake checks them.
    kwargs = _routing(tokens, experts, groups, topk_group, topk, seed=tokens, strided=strided)
    expected = spec.SPEC.reference(**kwargs)
    actual = adapter.grouped_topk(**kwargs)
    spec.SPEC.check_close(actual, expected, kwargs)
    assert len(vendor.CALLS) == (1 if tokens else 0)


@pytest.mark.parametrize("changes, platform, reason", [
    (dict(scoring_func="softmax"), "sm_90", "DeepSeek-V3 routing only"),
    (dict(e_score_correction_bias=None), "sm_90", "DeepSeek-V3 routing only"),
    (dict(renormalize=False), "sm_90", "DeepSeek-V3 routing only"),
    (dict(gating_output=torch.randn(4, 256).bfloat16()), "sm_90", "fp32 logits only"),
    (dict(topk=9), "sm_90", "topk 9 > 8"),
    (dict(num_expert_group=4), "sm_90", "64 experts per group > 32"),
    (dict(topk_group=5), "sm_90", "160 experts in the kept groups > 128"),
    (dict(num_expert_group=1, topk_group=1, topk=4, gating_output=torch.randn(4, 64),
          e_score_correction_bias=torch.randn(64)), "sm_90", "topk_group * num_expert_group = 1 < topk 4"),
    (dict(topk=6), "sm_90", "(256, 8, 4, 6) is not among those confirmed"),
    (dict(gating_output=torch.randn(4, 160), e_score_correction_bias=torch.randn(160)), "sm_90",
     "(160, 8, 4, 8) is not among those confirmed"),
    ({}, "sm_80", "not sm_80"),
])
def test_supports_declines_by_name(changes, platform, reason):
    kwargs = {**_routing(4, 256, 8, 4, 8, seed=1), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(platform))


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    # A release that reorders the parameters (as aiter#3391 did to another API) changes nothing.
    fake = sources("flashinfer")
    shipped = fake["flashinfer/fused_moe/__init__.py"]
    reordered = shipped.replace(
        "def fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values,\n"
        "                        topk_indices,",
        "def fused_topk_deepseek(topk_indices, topk_values, topk, topk_group, n_group, bias, scores,\n"
        "                        routed_scaling_factor,")
    assert reordered != shipped
    _install(monkeypatch, tmp_path, files={**fake, "flashinfer/fused_moe/__init__.py": reordered})
    kwargs = _routing(9, 256, 8, 4, 8, seed=3)
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("version, files, reason", [
    ("0.7.2", None, "flashinfer-python 0.7.2 is outside the tested range >=0.6.14,<0.7"),
    ("0.6.14", {"flashinfer/__init__.py": "raise RuntimeError('ROCm version file not found')\n"},
     "flashinfer-python 0.6.14: import flashinfer failed: RuntimeError: ROCm version file not found"),
    ("0.6.14", {"flashinfer/__init__.py": "", "flashinfer/fused_moe/__init__.py":
                "def fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor):\n    pass\n"},
     "fused_topk_deepseek takes no keyword topk_values, topk_indices"),
])
def test_a_broken_vendor_is_quarantined_with_its_version_and_reason(monkeypatch, tmp_path, version, files, reason):
    _install(monkeypatch, tmp_path, version, files)
    assert reason in FLASHINFER.problem_for(CALLS["grouped_topk"])
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    rejected = {impl.backend: why for impl, why in engine.tables["grouped_topk"].rejected}
    assert reason in rejected["flashinfer"]


def test_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_vendor, "_problems", {})
    monkeypatch.setattr(type(FLASHINFER), "version", lambda self: None)
    assert FLASHINFER.problem() == "flashinfer-python is not installed (pip install 'kernelmux[flashinfer]')"


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["grouped_topk"].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith("flashinfer-python 0.6.14: fused_topk_deepseek")
    assert engine.distribution("flashinfer").startswith("kernelmux ")
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["grouped_topk"].rejected}
    assert "needs a cuda platform" in on_cpu["flashinfer"]


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    kwargs = _routing(3, 256, 8, 4, 8, seed=5)
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        adapter.grouped_topk(**kwargs)
        adapter.grouped_topk(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and f"first call for cpu on {detect().arch} may compile" in messages[0] and "took" in messages[1]
    assert list(_vendor.first_calls.seconds()) == [("flashinfer", "grouped_topk", torch.device("cpu"))]
