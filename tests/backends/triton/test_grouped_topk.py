"""The triton backend's fused grouped_topk against the spec's reference: compiled on CUDA tensors
where a GPU is present, else under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors."""

import importlib.util
import inspect
import os

import pytest
import torch

# The interpreter flag is read when @triton.jit decorates, i.e. when the kernel module is first
# imported, so it must be set before that import (and before triton's, to be safe).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "needs triton (pip install kernelmux[test] on Linux x86_64)", allow_module_level=True
    )

from fakes import ask  # noqa: E402
from kernelmux.backends.triton import grouped_topk as triton_grouped_topk  # noqa: E402
from kernelmux.backends.triton.grouped_topk import (  # noqa: E402
    _CONFIG_TABLE,
    MAX_PADDED_EXPERTS,
    MAX_UNROLLED_PICKS,
    LaunchConfig,
    force_64bit_offsets,
    grouped_topk,
    launch_config,
    override_launch_config,
    supports,
)
from kernelmux.specs import grouped_topk as spec_module  # noqa: E402
from kernelmux.specs.grouped_topk import SPEC  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

if not ON_GPU and not isinstance(
    triton_grouped_topk._kernel(), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

SEEDS = (0, 1, 2)
MAX_ROWS = 1024
# The interpreter's cost is per program, not per element: above this many rows the spec cases run
# with one wide block per program (the table's own configs are covered by test_each_table_config).
INTERPRETER_DEFAULT_CONFIG_MAX_ROWS = 16
INTERPRETER_WIDE_CONFIG = LaunchConfig(block_t=256, num_warps=4)

CASES = [c for c in SPEC.cases if c.build("cpu", 0)["gating_output"].shape[0] <= MAX_ROWS]


def _run(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel, with one wide block per program for big batches under the interpreter."""
    rows = kwargs["gating_output"].shape[0]
    if ON_GPU or rows <= INTERPRETER_DEFAULT_CONFIG_MAX_ROWS:
        return grouped_topk(**kwargs)
    with override_launch_config(INTERPRETER_WIDE_CONFIG):
        return grouped_topk(**kwargs)


def _check(kwargs: dict, actual: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert ask(supports, SPEC, kwargs) is None
    SPEC.check_close(actual, SPEC.reference(**kwargs), kwargs)


def _assert_sane(kwargs: dict, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Every output element was written: finite weights, in-range and distinct ids per row."""
    num_tokens, num_experts = kwargs["gating_output"].shape
    topk = kwargs["topk"]
    assert weights.shape == (num_tokens, topk) and weights.dtype == torch.float32
    assert ids.shape == (num_tokens, topk) and ids.dtype == torch.int32
    assert bool(weights.isfinite().all())
    ids64 = ids.long().cpu()
    assert bool(((ids64 >= 0) & (ids64 < num_experts)).all())
    if topk > 1:
        sorted_ids = ids64.sort(dim=1).values
        assert bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()), "an expert chosen twice"


def test_signatures_match_the_spec() -> None:
    assert inspect.signature(grouped_topk) == SPEC.signature
    assert list(inspect.signature(supports).parameters) == ["key", "platform"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_spec_case(case, seed: int) -> None:
    kwargs = case.build(DEVICE, seed)
    _check(kwargs, _run(kwargs))


def test_empty_batch_returns_empty_outputs() -> None:
    kwargs = SPEC.case("empty").build(DEVICE, 0)
    weights, ids = grouped_topk(**kwargs)
    assert weights.shape == (0, kwargs["topk"]) and weights.dtype == torch.float32
    assert ids.shape == (0, kwargs["topk"]) and ids.dtype == torch.int32
    assert weights.device == ids.device == kwargs["gating_output"].device


@pytest.mark.parametrize("layout", ["column_slice", "strided_columns", "transposed"])
def test_non_contiguous_logits(layout: str) -> None:
    kwargs = SPEC.case("deepseek_v3_t64").build(DEVICE, 3)
    logits = kwargs["gating_output"]
    num_tokens, num_experts = logits.shape
    if layout == "column_slice":  # row stride E + 7, unit column stride
        wide = torch.full((num_tokens, num_experts + 7), float("nan"), device=DEVICE)
        wide[:, 3 : 3 + num_experts] = logits
        view = wide[:, 3 : 3 + num_experts]
    elif layout == "strided_columns":  # column stride 2
        wide = torch.full((num_tokens, 2 * num_experts), float("nan"), device=DEVICE)
        wide[:, ::2] = logits
        view = wide[:, ::2]
    else:  # [E, T] storage: column stride T, row stride 1
        view = logits.t().contiguous().t()
    assert not view.is_contiguous()
    kwargs["gating_output"] = view
    _check(kwargs, _run(kwargs))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
def test_bias_dtype_differs_from_logits(
    logit_dtype: torch.dtype, bias_dtype: torch.dtype
) -> None:
    kwargs = SPEC.case("deepseek_v3_t64").build(DEVICE, 4)
    kwargs["gating_output"] = kwargs["gating_output"].to(logit_dtype)
    kwargs["e_score_correction_bias"] = kwargs["e_score_correction_bias"].to(bias_dtype)
    _check(kwargs, _run(kwargs))


def test_strided_bias() -> None:
    kwargs = SPEC.case("small_sigmoid_bias").build(DEVICE, 5)
    bias = kwargs["e_score_correction_bias"]
    wide = torch.zeros(2 * bias.shape[0], dtype=bias.dtype, device=DEVICE)
    wide[::2] = bias
    kwargs["e_score_correction_bias"] = wide[::2]
    _check(kwargs, _run(kwargs))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_outputs_fully_written(case) -> None:
    # Outputs come from torch.empty: any element the kernel skipped would hold garbage.
    kwargs = case.build(DEVICE, 6)
    _assert_sane(kwargs, *_run(kwargs))


# One shape per padded-width bucket of the table (spec's own tie-free input maker, private).
_BUCKET_SHAPES = {
    # E, G, topk_group, topk, scoring, bias
    64: (64, 4, 2, 6, "softmax", False),
    256: (256, 8, 4, 8, "sigmoid", True),
    MAX_PADDED_EXPERTS: (768, 8, 3, 8, "sigmoid", True),  # 8 x next_pow2(96) = 1024 lanes
}


@pytest.mark.parametrize(
    "max_padded,config",
    [(max_padded, config) for _, max_padded, config in _CONFIG_TABLE],
    ids=[f"T<={t}-E<={e}-bt{c.block_t}-w{c.num_warps}" for t, e, c in _CONFIG_TABLE],
)
def test_each_table_config(max_padded: int, config: LaunchConfig) -> None:
    # 2.5 blocks of rows: two full programs and a partial one (rows past T masked).
    num_tokens = 2 * config.block_t + max(config.block_t // 2, 1)
    experts, groups, topk_group, topk, scoring, with_bias = _BUCKET_SHAPES[max_padded]
    make = spec_module._maker(num_tokens, experts, groups, topk_group, topk, scoring, with_bias)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(7))
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with override_launch_config(config):
        assert launch_config(num_tokens, experts) == config
        weights, ids = grouped_topk(**kwargs)
    _assert_sane(kwargs, weights, ids)
    _check(kwargs, (weights, ids))


def test_launch_config_table_and_override() -> None:
    assert launch_config(1, 256) == LaunchConfig(block_t=1, num_warps=1)
    # The measured row: one row per 1-warp program at every T for E <= 256.
    assert launch_config(16384, 256) == LaunchConfig(block_t=1, num_warps=1)
    assert launch_config(1024, 8) == _CONFIG_TABLE[1][2]
    assert launch_config(64, 1000) == _CONFIG_TABLE[4][2]
    assert launch_config(100000, 1000) == _CONFIG_TABLE[5][2]
    sweep = LaunchConfig(block_t=3, num_warps=2)
    outer = LaunchConfig(block_t=5, num_warps=1)
    with override_launch_config(outer):
        with override_launch_config(sweep):
            assert launch_config(1, 256) == sweep
        assert launch_config(1, 256) == outer
    assert launch_config(1, 256) == LaunchConfig(block_t=1, num_warps=1)
    with pytest.raises(AttributeError):
        sweep.block_t = 4  # frozen


def test_supports_limits() -> None:
    kwargs = SPEC.case("one_token").build(DEVICE, 0)
    assert ask(supports, SPEC, kwargs) is None
    wide = dict(kwargs, gating_output=torch.zeros(1, 2048, device=DEVICE), e_score_correction_bias=None)
    reason = ask(supports, SPEC, wide)
    assert reason is not None and "2048" in reason
    # 3 groups of 300 pad to 4 x 512 = 2048 lanes even though E = 900 < 1024.
    padded = dict(wide, gating_output=torch.zeros(1, 900, device=DEVICE), num_expert_group=3)
    assert ask(supports, SPEC, padded) is not None
    many = dict(kwargs, topk=MAX_UNROLLED_PICKS + 1, topk_group=kwargs["num_expert_group"])
    assert "topk" in ask(supports, SPEC, many)


def test_equal_top_two_in_a_group_both_count() -> None:
    # Groups 0 and 2 hold their best score twice: summing both keeps them (1.76, 1.46 against
    # 1.19 and 0.96); removing every lane equal to the max would keep groups 1 and 3 instead.
    row = [2.0, 2.0, -3.0, -3.0, 2.5, -1.0, -2.0, -3.0, 1.0, 1.0, -4.0, -4.0, 3.0, -5.0, -5.0, -5.0]
    logits = torch.tensor([row, row[::-1]], device=DEVICE)
    kwargs = {
        "gating_output": logits,
        "topk": 4,
        "renormalize": True,
        "num_expert_group": 4,
        "topk_group": 2,
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "e_score_correction_bias": torch.zeros(16, device=DEVICE),
    }
    weights, ids = grouped_topk(**kwargs)
    assert ids[0].sort().values.tolist() == [0, 1, 8, 9]
    assert ids[1].sort().values.tolist() == [6, 7, 14, 15]
    _check(kwargs, (weights, ids))


@pytest.mark.parametrize("seed", range(4))
def test_ties_go_to_the_lowest_ids(seed: int) -> None:
    # Heavily tied rows (logits drawn from 3 values, bias 0): the choice at a tie is the lowest
    # expert id, in the group stage and in the expert stage. The reference's
    # torch.topk does not promise that order, so the expected ids are computed here by a stable
    # sort on (-value, id).
    gen = torch.Generator().manual_seed(seed)
    num_tokens, experts, groups, topk_group, topk = 8, 32, 4, 2, 5
    logits = torch.tensor([-1.0, 0.0, 1.0])[torch.randint(0, 3, (num_tokens, experts), generator=gen)]
    kwargs = {
        "gating_output": logits.to(DEVICE),
        "topk": topk,
        "renormalize": False,
        "num_expert_group": groups,
        "topk_group": topk_group,
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "e_score_correction_bias": torch.zeros(experts, device=DEVICE),
    }
    weights, ids = grouped_topk(**kwargs)
    scores = logits.sigmoid()
    grouped = scores.view(num_tokens, groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    for t in range(num_tokens):
        order = sorted(range(groups), key=lambda g: (-float(group_scores[t, g]), g))
        kept = set(order[:topk_group])
        cand = [e for e in range(experts) if e // (experts // groups) in kept]
        want = sorted(cand, key=lambda e: (-float(scores[t, e]), e))[:topk]
        assert ids[t].cpu().tolist() and sorted(ids[t].cpu().tolist()) == sorted(want), t
    torch.testing.assert_close(weights.cpu(), scores.gather(1, ids.cpu().long()))


def test_offsets_are_64bit_exactly_when_needed() -> None:
    # Meta tensors: the shapes and strides of > 8 GiB logits without the memory.
    def constexprs(logits, topk=8, bias=None):
        return triton_grouped_topk._host_constexprs(logits, topk, bias)

    small = torch.empty(16384, 256, device="meta")
    assert constexprs(small)["OFFSETS_64"] is False
    # Last element offset (T - 1) * 256 + 255 = 2**31 - 1: still fits; one more row does not.
    assert constexprs(torch.empty(2**23, 256, device="meta"))["OFFSETS_64"] is False
    assert constexprs(torch.empty(2**23 + 1, 256, device="meta"))["OFFSETS_64"] is True
    # A transposed view: the expert stride is T.
    assert constexprs(torch.empty(256, 2**23 + 1, device="meta").t())["OFFSETS_64"] is True
    # Outputs: T * topk elements.
    assert constexprs(torch.empty(2**28, 1, device="meta"), topk=8)["OFFSETS_64"] is True
    with force_64bit_offsets():
        assert constexprs(small)["OFFSETS_64"] is True
        with force_64bit_offsets(False):
            assert constexprs(small)["OFFSETS_64"] is False
        assert constexprs(small)["OFFSETS_64"] is True
    assert constexprs(small)["OFFSETS_64"] is False


@pytest.mark.parametrize(
    "case", ["deepseek_v3_t64", "small_sigmoid_bias", "small_softmax", "one_token", "groups_of_one"]
)
def test_64bit_offsets(case: str) -> None:
    # The int64 offset path (taken for huge tensors only) against the reference, plain and with
    # a transposed view (expert stride T) and a row-padded view (row stride E + 7).
    kwargs = SPEC.case(case).build(DEVICE, 8)
    logits = kwargs["gating_output"]
    views = [logits, logits.t().contiguous().t()]
    wide = torch.full((logits.shape[0], logits.shape[1] + 7), float("nan"), device=DEVICE)
    wide[:, 3 : 3 + logits.shape[1]] = logits
    views.append(wide[:, 3 : 3 + logits.shape[1]])
    with force_64bit_offsets():
        for view in views:
            kw = dict(kwargs, gating_output=view)
            _check(kw, _run(kw))


SWEEP_CONFIGS = [
    LaunchConfig(block_t=bt, num_warps=w)
    for bt in (1, 2, 4, 8, 16, 32)
    for w in (1, 2, 4, 8)
    if LaunchConfig(block_t=bt, num_warps=w) not in triton_grouped_topk.KNOWN_BAD_CONFIGS
]


@pytest.mark.skipif(
    not ON_GPU,
    reason="GPU only: compiles every launch configuration for the device (a miscompile depends "
    "on the layout, which the interpreter does not have); run on the GPU with perf/run_gpu.sh",
)
@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=lambda c: f"bt{c.block_t}w{c.num_warps}")
@pytest.mark.parametrize("case_name", ["deepseek_v3_t64", "deepseek_v2_t1024", "small_softmax"])
def test_every_launch_config_compiled(config: LaunchConfig, case_name: str) -> None:
    kwargs = SPEC.case(case_name).build(DEVICE, 17)
    with override_launch_config(config):
        actual = grouped_topk(**kwargs)
    _check(kwargs, actual)


def test_known_bad_configs_are_refused() -> None:
    for config in triton_grouped_topk.KNOWN_BAD_CONFIGS:
        with pytest.raises(ValueError, match="wrong results under Triton 3.6"):
            with override_launch_config(config):
                pass
    for _, _, config in _CONFIG_TABLE:
        assert config not in triton_grouped_topk.KNOWN_BAD_CONFIGS
