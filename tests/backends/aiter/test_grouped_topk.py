"""The aiter backend's grouped_topk against the fake aiter (tests/vendors/aiter: the compiled ops'
schemas, the launcher's checks, routing in fp64): results against the spec's reference, declines by
name, keyword calls through a reordered schema, and which kernel each routing reaches."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS
from kernelmux.backends.aiter import grouped_topk as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import grouped_topk as spec
from vendors import reversed_signature, sources


def _topk_calls():
    return sys.modules["aiter.ops.topk"].CALLS


@pytest.mark.parametrize("case", ["deepseek_v3_t1", "deepseek_v3_t64", "deepseek_v3_bf16_t1024", "deepseek_v2_t1024",
                                  "qwen3_30b_a3b_t1024", "mixtral_8x7b_t1024", "empty"])
def test_the_spec_cases_it_accepts_match_the_reference(gfx942, case):
    kwargs = spec.SPEC.case(case).build("cpu")
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942")) is None
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("case, reason", [
    ("small_sigmoid_bias", "6 experts per group is not a multiple of the kernel's 4-expert vector loads"),
    ("small_softmax", "num_expert_group in [1, 2, 4, 8] only"),
    ("groups_of_one", "num_expert_group in [1, 2, 4, 8] only"),
    ("one_token", "with a correction bias, sigmoid scores only"),
    ("topk_equals_kept", "num_expert_group 1 or 8 only: for 4 groups"),
    ("all_groups_kept", "num_expert_group 1 or 8 only: for 4 groups"),
])
def test_the_spec_cases_it_declines_say_why(case, reason):
    kwargs = spec.SPEC.case(case).build("cpu")
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx950"))


def _routing(tokens, experts, groups, topk_group, topk, seed, *, bias=True, scoring="sigmoid",
             dtype=torch.float32, bias_dtype=None, strided=False, renormalize=True):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts * (2 if strided else 1), generator=generator) * 2).to(dtype)
    correction = (torch.rand(experts, generator=generator) * 0.2 - 0.1).to(bias_dtype or dtype) if bias else None
    return dict(gating_output=logits[:, ::2] if strided else logits, topk=topk, renormalize=renormalize,
                num_expert_group=groups, topk_group=topk_group, scoring_func=scoring, routed_scaling_factor=2.5,
                e_score_correction_bias=correction)


@pytest.mark.parametrize("kwargs, kernel", [
    (_routing(33, 256, 8, 4, 8, 1), "biased_grouped_topk_hip"),  # DeepSeek-V3
    (_routing(9, 64, 1, 1, 6, 2), "biased_grouped_topk_hip"),  # one group: no group selection
    (_routing(8, 256, 8, 4, 8, 7, renormalize=False), "biased_grouped_topk_hip"),  # weights as scored
    (_routing(5, 256, 8, 4, 8, 3, dtype=torch.bfloat16, bias_dtype=torch.float32), "biased_grouped_topk_hip"),
    (_routing(7, 160, 8, 3, 6, 4, bias=False, scoring="softmax"), "grouped_topk"),  # DeepSeek-V2
    (_routing(6, 96, 4, 2, 5, 5, bias=False), "grouped_topk"),  # sigmoid without a bias
    (_routing(7, 64, 2, 1, 4, 6, bias=False, scoring="softmax", strided=True), "grouped_topk"),
])
def test_adapter_matches_the_reference(gfx942, kwargs, kernel):
    # Ties are not drawn near the selection boundaries at these sizes (checked by the reference's own
    # comparison of rows as sets: a tie would fail it on either side).
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942")) is None
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    [call] = _topk_calls()
    assert call["op"] == kernel
    # A bias of another dtype than the logits: both reach the kernel in fp32 (it reads the bias as the
    # logits' type), never the bias rounded to bf16.
    bias = kwargs["e_score_correction_bias"]
    if bias is not None and bias.dtype != kwargs["gating_output"].dtype:
        assert call["dtype"] == torch.float32


def test_an_empty_batch_never_reaches_the_vendor(gfx942):
    weights, ids = adapter.grouped_topk(**_routing(0, 256, 8, 4, 8, 0))
    assert weights.shape == ids.shape == (0, 8) and _topk_calls() == []


@pytest.mark.parametrize("changes, reason", [
    (dict(num_expert_group=16, gating_output=torch.randn(4, 256)), "num_expert_group in [1, 2, 4, 8] only"),
    (dict(num_expert_group=4), "num_expert_group 1 or 8 only: for 4 groups"),
    (dict(num_expert_group=2, topk_group=1), "for 2 groups the kernel reduces the group top-2 over 32 lanes"),
    (dict(scoring_func="softmax"), "sigmoid scores only"),
    (dict(topk=65, topk_group=8, gating_output=torch.randn(4, 256)), "topk 65 > 64"),
    (dict(gating_output=torch.randn(4, 24), e_score_correction_bias=None, num_expert_group=4, topk_group=2,
          topk=3), "6 experts per group is not a multiple of the kernel's 4-expert vector loads"),
])
def test_supports_declines_by_name(changes, reason):
    kwargs = {**_routing(4, 256, 8, 4, 8, 1), **changes}
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942"))


def test_the_declined_shapes_are_the_kernels_limits(gfx942):
    # The fake refuses what supports declines: 4 groups with a bias is a wrong result on the GPU.
    kwargs = _routing(4, 256, 4, 2, 8, 1)
    with pytest.raises(AssertionError, match="not reduced across"):
        adapter.grouped_topk(**kwargs)


@pytest.mark.parametrize("function", ["biased_grouped_topk_hip", "grouped_topk"])
def test_the_vendor_is_called_by_keyword(install_aiter, function):
    # A release that reorders a stub's parameters reorders the op's schema; keyword calls still land.
    fake = sources("aiter")
    install_aiter(files={**fake, "aiter/ops/topk.py": reversed_signature(fake["aiter/ops/topk.py"], function)})
    assert AITER.problem_for(CALLS["grouped_topk"]) is None
    biased = function == "biased_grouped_topk_hip"
    kwargs = _routing(17, 256, 8, 4, 8, 9, bias=biased, scoring="sigmoid" if biased else "softmax")
    spec.SPEC.check_close(adapter.grouped_topk(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


def test_a_renamed_keyword_is_caught_by_the_schema_probe(install_aiter):
    # The Python forwarder takes (*args, **kwargs): only the op's schema can show the rename.
    fake = sources("aiter")
    renamed = fake["aiter/ops/topk.py"].replace("    topk_grp: int,", "    topk_group: int,").replace(
        "topk_grp)", "topk_group)")
    install_aiter(files={**fake, "aiter/ops/topk.py": renamed})
    reason = AITER.problem_for(CALLS["grouped_topk"])
    assert "torch.ops.aiter.biased_grouped_topk_hip takes no keyword topk_grp" in reason
