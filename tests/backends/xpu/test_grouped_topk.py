"""The xpu backend's grouped_topk against the fake vllm-xpu-kernels (tests/vendors/vllm_xpu_kernels, whose
_moe_C.grouped_topk has the shipped schema and models the kernel's arithmetic): results against the
spec's reference, the declines and why they are needed (keyword calls: test_backend.py)."""

from __future__ import annotations

import pytest
import torch

from fakes import ask
from kernelmux.backends.xpu import grouped_topk as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import grouped_topk as spec

XPU = simulate("xpu")


def _routing(tokens, experts, groups, topk_group, topk, seed, scoring="sigmoid", bias=True, dtype=torch.float32,
             strided=False, renormalize=True):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts * (2 if strided else 1), generator=generator) * 2).to(dtype)
    return dict(gating_output=logits[:, ::2] if strided else logits, topk=topk, renormalize=renormalize,
                num_expert_group=groups, topk_group=topk_group, scoring_func=scoring, routed_scaling_factor=2.5,
                e_score_correction_bias=(torch.rand(experts, generator=generator) * 0.2 - 0.1) if bias else None)


# The quick cases it declines, and why (bias-free routing that drops groups; groups of one expert).
DECLINED_CASES = {"small_softmax": "without a correction bias", "groups_of_one": "groups of at least 2 experts"}


@pytest.mark.parametrize("case", [c.name for c in spec.SPEC.cases_tagged("quick")])
def test_the_spec_cases_match_the_reference_or_are_declined(vendor, case):
    kwargs = spec.SPEC.case(case).build(seed=11)
    reason = ask(adapter.supports, spec.SPEC, kwargs, XPU)
    if case in DECLINED_CASES:
        assert DECLINED_CASES[case] in reason
        return
    assert reason is None
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("tokens, experts, groups, topk_group, topk, scoring, bias, dtype, strided", [
    (33, 256, 8, 4, 8, "sigmoid", True, torch.float32, False),   # DeepSeek-V3: the fused sigmoid
    (9, 64, 4, 2, 6, "sigmoid", True, torch.bfloat16, False),    # bf16 logits: scored in fp32 first
    (7, 60, 6, 6, 5, "softmax", False, torch.float16, True),     # softmax, all groups kept, a strided view
    (5, 40, 1, 1, 32, "softmax", False, torch.float32, False),   # one group, the largest topk
    (0, 256, 8, 4, 8, "sigmoid", True, torch.float32, False),    # an empty batch never reaches the kernel
])
def test_adapter_matches_the_reference(vendor, tokens, experts, groups, topk_group, topk, scoring, bias, dtype,
                                       strided):
    kwargs = _routing(tokens, experts, groups, topk_group, topk, seed=tokens, scoring=scoring, bias=bias,
                      dtype=dtype, strided=strided)
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    calls = vendor["_moe_C"].CALLS
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    if tokens:
        [(_, call)] = calls
        fused = scoring == "sigmoid" and dtype == torch.float32
        assert call["scoring_func"] == (adapter.SCORING_SIGMOID if fused else adapter.SCORING_NONE)
        assert call["dtype"] == (dtype if fused else torch.float32)
    else:
        assert calls == []


def test_bf16_logits_handed_over_as_they_are_would_be_wrong(vendor):
    # Why 16-bit logits are scored here: the kernel computes in the scores' dtype, so its weights are
    # bf16-rounded sigmoids, 2^-9 off where the spec allows 2e-5.
    kwargs = _routing(16, 64, 4, 2, 6, seed=3, dtype=torch.bfloat16)
    weights, ids = torch.ops._moe_C.grouped_topk(
        scores=kwargs["gating_output"], n_group=4, topk_group=2, topk=6, renormalize=True, routed_scaling_factor=2.5,
        bias=kwargs["e_score_correction_bias"], scoring_func=adapter.SCORING_SIGMOID)
    with pytest.raises(AssertionError, match="grouped_topk (ids|weights)"):  # rounding moves choices too
        spec.SPEC.check_close((weights, ids), spec.SPEC.reference(**kwargs), kwargs)


def test_without_a_bias_group_selection_would_differ(vendor):
    # Why bias-free calls that drop groups are declined: the kernel scores a group by its top-2 sum.
    kwargs = _routing(64, 32, 8, 2, 4, seed=5, scoring="softmax", bias=False)
    scores = torch.softmax(kwargs["gating_output"], dim=-1)
    got = torch.ops._moe_C.grouped_topk(scores=scores, n_group=8, topk_group=2, topk=4, renormalize=True,
                                        routed_scaling_factor=2.5, bias=torch.zeros(32),
                                        scoring_func=adapter.SCORING_NONE)
    with pytest.raises(AssertionError, match="choose other experts"):
        spec.SPEC.check_close(got, spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("changes, reason", [
    (dict(num_expert_group=64, topk_group=8, gating_output=torch.randn(4, 256)), "num_expert_group <= 32"),
    (dict(topk=33, gating_output=torch.randn(4, 256), num_expert_group=1, topk_group=1,
          e_score_correction_bias=torch.randn(256)), "topk <= 32"),
    (dict(e_score_correction_bias=None), "without a correction bias only when every group is kept"),
    (dict(e_score_correction_bias=None, gating_output=torch.randn(4, 16), num_expert_group=16, topk_group=16),
     "groups of at least 2 experts"),
])
def test_supports_declines_by_name(changes, reason):
    kwargs = {**_routing(4, 256, 8, 4, 8, seed=1), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, XPU)
