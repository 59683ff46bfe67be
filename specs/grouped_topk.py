"""grouped_topk: DeepSeek-style group-limited MoE routing; the spec, its reference and its cases."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_choice, check_float, check_int, check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "grouped_topk"]

NAME = "grouped_topk"
SCORING_FUNCS = ("softmax", "sigmoid")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to ``topk`` experts chosen only from its ``topk_group`` best expert groups.

    Args:
        gating_output: ``[T, E]`` router logits, fp32/bf16/fp16, any strides.
        topk: experts per token, ``1 <= topk <= topk_group * E / G``.
        renormalize: divide each row's weights by their sum.
        num_expert_group: ``G`` groups of ``E / G`` consecutive experts; ``E % G == 0``.
        topk_group: groups kept per token, ``1 <= topk_group <= G``.
        scoring_func: ``"softmax"`` (over all E) or ``"sigmoid"``; computed in fp32.
        routed_scaling_factor: multiplies the weights after renormalization.
        e_score_correction_bias: ``[E]`` or None. Added to the scores for *selection* only
            (group score = sum of the group's top-2 biased scores, ``E / G >= 2``); without it the
            group score is the group's max score.

    Returns:
        ``weights [T, topk] fp32``: the unbiased scores of the chosen experts (renormalized, scaled)
        and ``ids [T, topk] int32``: the chosen experts. Order within a row is unspecified.
    """
    logits = gating_output.float()
    num_tokens, num_experts = logits.shape
    group_size = num_experts // num_expert_group
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)

    if e_score_correction_bias is not None:
        biased = scores + e_score_correction_bias.float()
        groups = biased.view(num_tokens, num_expert_group, group_size)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    else:
        biased = scores
        group_scores = scores.view(num_tokens, num_expert_group, group_size).amax(dim=-1)

    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(group_size, dim=1)
    candidates = biased.masked_fill(~expert_kept, float("-inf"))

    ids = candidates.topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


class Key(NamedTuple):
    """grouped_topk's dispatch key: what an implementation may decide on (OpSpec.key)."""

    device: torch.device
    logits_dtype: torch.dtype
    num_experts: int
    num_expert_group: int
    topk_group: int
    topk: int
    renormalize: bool
    scoring_func: str
    routed_scaling_factor: float
    bias_dtype: Optional[torch.dtype]  # None: no correction bias
    num_tokens_class: int
    gating_output_layout: Layout
    e_score_correction_bias_layout: Optional[Layout]


def validate(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "gating_output", gating_output, dtypes=LOGIT_DTYPES, rank=2)
    device = gating_output.device  # read once: building a torch.device costs ~0.3 us
    num_experts = gating_output.shape[1]
    check_int(NAME, "num_expert_group", num_expert_group, low=1)
    if num_experts % num_expert_group:
        raise InvalidArgumentError(
            NAME,
            "num_expert_group",
            f"a divisor of the number of experts E = gating_output.shape[1] = {num_experts}",
            num_expert_group,
        )
    check_int(NAME, "topk_group", topk_group, low=1, high=num_expert_group)
    group_size = num_experts // num_expert_group
    check_int(NAME, "topk", topk, low=1, high=topk_group * group_size)
    if type(renormalize) is not bool:
        raise InvalidArgumentError(NAME, "renormalize", "a bool", type(renormalize).__name__)
    check_choice(NAME, "scoring_func", scoring_func, SCORING_FUNCS)
    check_float(NAME, "routed_scaling_factor", routed_scaling_factor)
    bias_dtype = None
    if e_score_correction_bias is not None:
        check_tensor(
            NAME,
            "e_score_correction_bias",
            e_score_correction_bias,
            dtypes=LOGIT_DTYPES,
            rank=1,
            device=device,
        )
        if e_score_correction_bias.shape[0] != num_experts:
            raise InvalidArgumentError(
                NAME,
                "e_score_correction_bias",
                f"shape ({num_experts},) to match gating_output's E",
                tuple(e_score_correction_bias.shape),
            )
        if group_size < 2:
            raise InvalidArgumentError(
                NAME,
                "num_expert_group",
                "at most E / 2 groups when a correction bias is given (group score = top-2 sum)",
                num_expert_group,
            )
        bias_dtype = e_score_correction_bias.dtype
    return Key(
        device=device, logits_dtype=gating_output.dtype, num_experts=num_experts,
        num_expert_group=num_expert_group, topk_group=topk_group, topk=topk, renormalize=renormalize,
        scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor, bias_dtype=bias_dtype,
        num_tokens_class=size_class(gating_output.shape[0]), gating_output_layout=layout(gating_output),
        e_score_correction_bias_layout=layout(e_score_correction_bias),
    )


def fake(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = gating_output.shape[0]
    device = gating_output.device
    return (
        torch.empty((num_tokens, topk), dtype=torch.float32, device=device),
        torch.empty((num_tokens, topk), dtype=torch.int32, device=device),
    )


# The math is fp32 whatever the logit dtype (inputs are upcast exactly), so one tolerance serves
# all three; it allows for exp/sigmoid implementations that differ by a few ulp (Triton's exp
# lowers to ex2.approx) and for a different summation order in softmax and renormalization.
TOLERANCE = {dtype: Tolerance(atol=1e-6, rtol=2e-5) for dtype in LOGIT_DTYPES}


def canonical(outputs: Any, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` on the CPU with each row sorted by expert id (the order within a row is
    not part of the contract), ids as int64."""
    weights, ids = outputs
    sorted_ids, order = ids.long().cpu().sort(dim=1)
    return weights.cpu().gather(1, order), sorted_ids


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Rows are compared as sets: the same experts, and the same weight for each expert."""
    weights, ids = actual
    ref_weights, ref_ids = expected
    for got, want, what in ((weights, ref_weights, "weights"), (ids, ref_ids, "ids")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
    num_experts = kwargs["gating_output"].shape[1]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_experts):
        raise AssertionError(f"{NAME} ids: values outside [0, {num_experts}): {ids.unique()}")
    sorted_weights, sorted_ids = canonical(actual, kwargs)
    ref_sorted_weights, ref_sorted_ids = canonical(expected, kwargs)
    mismatch = (sorted_ids != ref_sorted_ids).any(dim=1).nonzero().flatten()
    if mismatch.numel():
        row = int(mismatch[0])
        raise AssertionError(
            f"{NAME} ids: {mismatch.numel()} of {ids.shape[0]} rows choose other experts; "
            f"row {row}: got {sorted_ids[row].tolist()}, expected {ref_sorted_ids[row].tolist()}"
        )
    assert_close(
        sorted_weights,
        ref_sorted_weights,
        TOLERANCE[kwargs["gating_output"].dtype],
        f"{NAME} weights (rows sorted by expert id)",
    )


def cost(kwargs: Mapping[str, Any]) -> Cost:
    logits = kwargs["gating_output"]
    bias = kwargs["e_score_correction_bias"]
    num_tokens, num_experts = logits.shape
    topk = kwargs["topk"]
    # About 8 elementwise operations per score (scoring, bias, group and top-k comparisons); the op
    # is memory-bound by a wide margin, so the FLOP count only has to be the right order.
    flops = 8 * num_tokens * num_experts
    bytes_moved = (
        logits.numel() * logits.element_size()
        + (bias.numel() * bias.element_size() if bias is not None else 0)
        + num_tokens * topk * (4 + 4)
    )
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases. Inputs are drawn so that no row has a near-tie at a selection boundary (the k-th vs the
# (k+1)-th group or expert): there the contract allows either choice, so a tie would make a
# correct implementation look wrong.

_MIN_RELATIVE_GAP = 1e-4  # fp32 implementations agree to ~1e-6; 1e-4 leaves a wide margin.


def _boundary_gaps(logits: torch.Tensor, bias: torch.Tensor | None, params: Mapping[str, Any]):
    """Relative gap at the group and the expert selection boundary of each row, in fp64."""
    x = logits.double()
    scores = x.softmax(-1) if params["scoring_func"] == "softmax" else x.sigmoid()
    biased = scores + bias.double() if bias is not None else scores
    num_tokens, num_experts = x.shape
    groups, kept_groups, topk = params["G"], params["topk_group"], params["topk"]
    grouped = biased.view(num_tokens, groups, num_experts // groups)
    group_scores = grouped.topk(2, -1).values.sum(-1) if bias is not None else grouped.amax(-1)

    def gap(values: torch.Tensor, k: int) -> torch.Tensor:
        if k >= values.shape[1]:
            return torch.full((values.shape[0],), float("inf"), dtype=values.dtype)
        top = values.topk(k + 1, dim=-1).values
        return (top[:, k - 1] - top[:, k]) / top[:, k - 1].abs().clamp_min(1e-30)

    group_gap = gap(group_scores, kept_groups)
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool)
    group_kept.scatter_(1, group_scores.topk(kept_groups, -1).indices, True)
    kept = group_kept.repeat_interleave(num_experts // groups, dim=1)
    candidates = biased.masked_fill(~kept, float("-inf"))
    expert_gap = gap(candidates, topk)
    # Equal top-2 members would still give equal group sums, so only the boundaries matter.
    return torch.minimum(group_gap, expert_gap.nan_to_num(float("inf")))


def _maker(
    tokens: int,
    experts: int,
    groups: int,
    topk_group: int,
    topk: int,
    scoring_func: str,
    with_bias: bool,
    dtype: torch.dtype = torch.float32,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
):
    params = {"G": groups, "topk_group": topk_group, "topk": topk, "scoring_func": scoring_func}

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        bias = None
        if with_bias:
            # DeepSeek-V3's learned biases are small offsets of the sigmoid scores.
            bias = (torch.rand(experts, generator=generator) * 0.2 - 0.1).to(dtype)
        logits = (torch.randn(tokens, experts, generator=generator) * 2).to(dtype)
        for _ in range(200):
            redraw = (_boundary_gaps(logits, bias, params) < _MIN_RELATIVE_GAP).nonzero().flatten()
            if redraw.numel() == 0:
                break
            fresh = torch.randn(redraw.numel(), experts, generator=generator) * 2
            logits[redraw] = fresh.to(dtype)
        else:
            raise RuntimeError(f"{NAME}: could not draw inputs free of near-ties")
        return {
            "gating_output": logits.to(device),
            "topk": topk,
            "renormalize": renormalize,
            "num_expert_group": groups,
            "topk_group": topk_group,
            "scoring_func": scoring_func,
            "routed_scaling_factor": routed_scaling_factor,
            "e_score_correction_bias": bias.to(device) if bias is not None else None,
        }

    return make


def _deepseek_v3(tokens: int, dtype: torch.dtype = torch.float32):
    # DeepSeek-V3: 256 routed experts in 8 groups, 4 groups kept, top 8, sigmoid with a correction
    # bias, weights renormalized then scaled by 2.5 (its config's routed_scaling_factor).
    return _maker(tokens, 256, 8, 4, 8, "sigmoid", True, dtype, True, 2.5)


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    cases = [
        Case(f"deepseek_v3_t{t}", _deepseek_v3(t), quick if t <= 1024 else model,
             f"DeepSeek-V3 routing at {t} tokens")
        for t in (1, 64, 1024, 8192, 16384)
    ]
    cases += [
        Case("deepseek_v3_bf16_t1024", _deepseek_v3(1024, torch.bfloat16), model,
             "DeepSeek-V3 routing with bf16 logits, as engines that keep the router in bf16 pass"),
        Case("deepseek_v2_t1024", _maker(1024, 160, 8, 3, 6, "softmax", False, torch.float32,
                                         False, 16.0), model,
             "DeepSeek-V2: 160 experts (groups of 20, not a power of two), softmax, no bias, "
             "no renormalization, scaled by 16"),
        Case("qwen3_30b_a3b_t1024", _maker(1024, 128, 1, 1, 8, "softmax", False), quick,
             "Qwen3-30B-A3B: one group, so plain softmax top-8 of 128"),
        Case("mixtral_8x7b_t1024", _maker(1024, 8, 1, 1, 2, "softmax", False, torch.bfloat16),
             quick, "Mixtral-8x7B: top-2 of 8, bf16 logits"),
        Case("small_sigmoid_bias", _maker(7, 24, 4, 2, 5, "sigmoid", True, torch.float16),
             frozenset({"random", "quick"}), "odd T, groups of 6, fp16 logits and bias"),
        Case("small_softmax", _maker(5, 12, 3, 2, 3, "softmax", False, torch.float32, True, 0.5),
             frozenset({"random", "quick"}), "3 groups (not a power of two), scaling below 1"),
        Case("empty", _maker(0, 256, 8, 4, 8, "sigmoid", True), frozenset({"edge", "quick"}),
             "T = 0: an empty batch must return empty outputs, not fail"),
        Case("one_token", _maker(1, 64, 8, 2, 4, "softmax", True), frozenset({"edge", "quick"}),
             "T = 1: the decode step of a single request"),
        Case("topk_equals_kept", _maker(9, 16, 4, 2, 8, "sigmoid", True),
             frozenset({"edge", "quick"}),
             "topk = topk_group * E / G: every expert of every kept group is chosen"),
        Case("all_groups_kept", _maker(6, 32, 4, 4, 6, "sigmoid", True),
             frozenset({"edge", "quick"}), "topk_group = G: group selection keeps everything"),
        Case("groups_of_one", _maker(6, 10, 10, 3, 3, "softmax", False),
             frozenset({"edge", "quick"}),
             "E / G = 1 (allowed without a bias): group selection is expert selection; E = 10 "
             "is not a power of two"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn routing problems: groups of 2-32 experts, any valid group and expert top-k."""
    groups = draw(st.sampled_from([1, 2, 4, 8]))
    per_group = draw(st.sampled_from([2, 4, 8, 16, 32]))
    topk_group = draw(st.integers(1, groups))
    topk = draw(st.integers(1, min(8, topk_group * per_group)))
    tokens = draw(st.integers(0, 40))
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    with_bias = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    renormalize = draw(st.booleans())
    scaling = draw(st.sampled_from([1.0, 2.5]))
    return drawn(f"T {tokens}, E {groups * per_group} in {groups} groups, top {topk_group} groups, top-{topk}, "
                 f"{scoring}{' + bias' if with_bias else ''}, {str(dtype)[6:]}, renormalize {renormalize}, "
                 f"scale {scaling}",
                 _maker(tokens, groups * per_group, groups, topk_group, topk, scoring, with_bias, dtype,
                        renormalize, scaling))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=grouped_topk,
    validate=validate,
    fake=fake,
    check_close=check_close,
    canonical=canonical,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
