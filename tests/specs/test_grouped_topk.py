"""The grouped_topk spec: its reference against hand-worked and loop oracles, its validation,
fake, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs import grouped_topk as spec_module
from kernelmux.specs.grouped_topk import SPEC

reference = SPEC.reference


def test_hand_worked_softmax_without_bias():
    # Groups of two: {0,1} max 5, {2,3} max 1, {4,5} max 4, {6,7} max 3. Keeping 2 groups keeps
    # {0,1} and {4,5}, so experts 6 and 7 (logit 3) lose to expert 4 (logit 4) and expert 0 is
    # the next best candidate; the top-2 is {1, 4}.
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0, 4.0, 0.0, 3.0, 3.0]])
    weights, ids = reference(logits, 2, True, 4, 2, "softmax")
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [1, 4]
    # Renormalized softmax of logits 5 and 4: 1 / (1 + e^-1) and 1 / (1 + e).
    expected = torch.tensor([1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))])
    torch.testing.assert_close(weights[0][order], expected, rtol=1e-6, atol=0)


def test_hand_worked_sigmoid_with_bias_uses_top2_group_sum():
    # All scores are sigmoid(0) = 0.5; the bias alone decides. Biased groups: {0,1} 1.0,
    # {2,3} 1.2, {4,5} 0.8 + 0.2 = 1.0, {6,7} 1.1. Group {4,5} holds the single best expert (0.8)
    # but loses on its top-2 sum, so groups {2,3} and {6,7} are kept and the top-2 is {2, 3}.
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, 0.0, 0.1, 0.1, 0.3, -0.3, 0.05, 0.05])
    weights, ids = reference(logits, 2, True, 4, 2, "sigmoid", 2.5, bias)
    assert sorted(ids[0].tolist()) == [2, 3]
    # Weights are the *unbiased* scores (0.5 each), renormalized to 0.5 and scaled by 2.5.
    torch.testing.assert_close(weights[0], torch.tensor([1.25, 1.25]), rtol=1e-6, atol=0)


def _loop_oracle(logits, topk, renormalize, groups, topk_group, scoring, scale, bias):
    """grouped_topk one token and one group at a time, in float64 Python arithmetic."""
    result = []
    for row in logits.double().tolist():
        if scoring == "softmax":
            peak = max(row)
            exps = [math.exp(v - peak) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        biased = [s + b for s, b in zip(scores, bias.double().tolist())] if bias is not None else scores
        size = len(row) // groups
        group_score = []
        for g in range(groups):
            members = sorted(biased[g * size:(g + 1) * size], reverse=True)
            group_score.append(members[0] + members[1] if bias is not None else members[0])
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: -biased[e])[:topk]
        weights = [scores[e] for e in chosen]
        if renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        result.append({e: w * scale for e, w in zip(chosen, weights)})
    return result


@given(
    tokens=st.integers(0, 6),
    groups=st.integers(1, 6),
    group_size=st.integers(2, 7),
    data=st.data(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    with_bias=st.booleans(),
    renormalize=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_loop_oracle(tokens, groups, group_size, data, scoring, with_bias,
                                       renormalize, scale, seed):
    topk_group = data.draw(st.integers(1, groups))
    topk = data.draw(st.integers(1, topk_group * group_size))
    make = spec_module._maker(tokens, groups * group_size, groups, topk_group, topk, scoring,
                              with_bias, torch.float32, renormalize, scale)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    weights, ids = reference(**kwargs)
    oracle = _loop_oracle(kwargs["gating_output"], topk, renormalize, groups, topk_group, scoring,
                          scale, kwargs["e_score_correction_bias"])
    assert weights.shape == ids.shape == (tokens, topk)
    for t, expected in enumerate(oracle):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected.keys(), f"row {t}"
        for expert, w in expected.items():
            assert got[expert] == pytest.approx(w, rel=1e-5, abs=1e-7), f"row {t} expert {expert}"


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")
    SPEC.validate(**kwargs)


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_cases_have_no_near_ties(case):
    kwargs = case.build(seed=11)
    params = {"G": kwargs["num_expert_group"], "topk_group": kwargs["topk_group"],
              "topk": kwargs["topk"], "scoring_func": kwargs["scoring_func"]}
    gaps = spec_module._boundary_gaps(kwargs["gating_output"], kwargs["e_score_correction_bias"], params)
    assert bool((gaps >= spec_module._MIN_RELATIVE_GAP).all())


def test_cases_cover_the_issue_shapes():
    names = {c.name for c in SPEC.cases}
    assert {f"deepseek_v3_t{t}" for t in (1, 64, 1024, 8192, 16384)} <= names
    assert {"empty", "one_token", "topk_equals_kept"} <= names
    assert SPEC.cases_tagged("quick")


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("deepseek_v3_t1024").build()
    cost = SPEC.cost(kwargs)
    assert cost.bytes == 1024 * 256 * 4 + 256 * 4 + 1024 * 8 * (4 + 4)
    assert cost.flops > 0


def _good(**changes):
    kwargs = dict(gating_output=torch.randn(4, 16), topk=4, renormalize=True, num_expert_group=4,
                  topk_group=2, scoring_func="sigmoid", routed_scaling_factor=1.0,
                  e_score_correction_bias=torch.zeros(16))
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"gating_output": torch.zeros(4, 16, dtype=torch.int32)}, "gating_output", "dtype in"),
        ({"gating_output": torch.zeros(2, 4, 16)}, "gating_output", "2-d tensor"),
        ({"gating_output": [[0.0] * 16]}, "gating_output", "torch.Tensor"),
        ({"num_expert_group": 3}, "num_expert_group", "divisor of the number of experts E"),
        ({"num_expert_group": 0}, "num_expert_group", ">= 1"),
        ({"topk_group": 5}, "topk_group", "[1, 4]"),
        ({"topk": 9}, "topk", "[1, 8]"),
        ({"topk": 0}, "topk", "[1, 8]"),
        ({"topk": torch.tensor(4)}, "topk", "a Python int"),
        ({"topk": 4.0}, "topk", "a Python int"),
        ({"renormalize": 1}, "renormalize", "a bool"),
        ({"scoring_func": "relu"}, "scoring_func", "one of"),
        ({"routed_scaling_factor": "2"}, "routed_scaling_factor", "float"),
        ({"e_score_correction_bias": torch.zeros(15)}, "e_score_correction_bias", "shape (16,)"),
        ({"e_score_correction_bias": torch.zeros(16, dtype=torch.int64)}, "e_score_correction_bias", "dtype"),
        ({"e_score_correction_bias": torch.zeros(16, device="meta")}, "e_score_correction_bias", "on cpu"),
        ({"num_expert_group": 16, "topk_group": 2, "topk": 2}, "num_expert_group", "top-2 sum"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "grouped_topk"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert key != SPEC.validate(**_good(gating_output=torch.randn(4, 16, dtype=torch.bfloat16)))
    # T enters as its power-of-two class: 4 and 7 share a key, 8 does not.
    assert key == SPEC.validate(**_good(gating_output=torch.randn(7, 16)))
    assert key != SPEC.validate(**_good(gating_output=torch.randn(8, 16)))
    column_major = SPEC.validate(**_good(gating_output=torch.randn(16, 4).t()))
    assert not column_major.gating_output_layout.unit_stride and key.gating_output_layout.unit_stride


def test_check_close_names_rows_that_choose_other_experts():
    kwargs = SPEC.case("deepseek_v3_t64").build(seed=4)
    weights, ids = reference(**kwargs)
    other = ids.clone()
    unchosen = [e for e in range(kwargs["gating_output"].shape[1]) if e not in ids[5].tolist()]
    other[5, 0] = unchosen[0]
    with pytest.raises(AssertionError, match=r"ids: 1 of 64 rows choose other experts; row 5"):
        SPEC.check_close((weights, other), (weights, ids), kwargs)
