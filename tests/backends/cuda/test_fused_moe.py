"""The cuda backend's Hopper fused_moe: what it accepts and why not, its compilation for sm_90a (NVRTC runs on
CPU-only machines) without spills, and on an sm_90 GPU against the spec's reference: every 16-bit case the
kernels compute (called directly: supports' floor on pairs per expert is a selection policy, not a limit of the
kernels), runs of several 128-row blocks, H and I off the 64-wide K steps and 128-wide column tiles, experts on
other ranks, top-1, fp16 and gelu, every plan, padded row strides, NaN-poisoned memory, and a CUDA-graph replay
on new routing."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import needs_hopper, needs_nvrtc
from fakes import ask
from kernelmux.backends.cuda import _compile, _driver
from kernelmux.backends.cuda import fused_moe as cuda_moe
from kernelmux.conformance import poison_freed_memory
from kernelmux.platforms import simulate
from kernelmux.specs import fused_moe as spec_module
from kernelmux.specs.fused_moe import SPEC

SM90, SM89 = simulate("sm_90"), simulate("sm_89")
PLANS = [cuda_moe.MoePlan(stages, persistent) for stages in cuda_moe.STAGES for persistent in (False, True)]
# Every 16-bit case whose router weight applies after down (the kernels' calls), and the sizes beyond the
# spec's small cases: one expert's run over several blocks, ragged H and I, a map with holes, top-1, fp16.
SERVED = [case.name for case in SPEC.cases if case.name in {
    "qwen3_30b_a3b_t16_ep16", "mixtral_8x7b_t4_ep8", "gpt_oss_120b_t8_bf16_ep32", "small_silu", "small_gelu_fp16",
    "empty", "one_token", "expert_map_with_holes", "all_tokens_one_expert", "topk_equals_experts"}]
LARGE = {
    # T, E, top-k, H, I, and _maker's options
    "runs_of_several_blocks": (600, 4, 2, 256, 192, {}),
    "ragged_h_and_i": (300, 6, 3, 200, 136, {"activation": "gelu"}),
    "map_holes_fp16": (257, 12, 3, 72, 40, {"unmapped": 5, "dtype": torch.float16}),
    "top1_with_a_map": (400, 8, 1, 128, 264, {"local_experts": 4}),
    "one_expert_takes_all": (513, 8, 3, 64, 32, {"one_expert": True}),
    "many_pairs": (6000, 8, 3, 64, 32, {}),  # 18000 pairs: 18 to each thread of the routing CTA
}


def _large(name: str, seed: int) -> dict:
    tokens, experts, topk, hidden_size, inter_size, options = LARGE[name]
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **options)
    return make(torch.device(DEVICE), torch.Generator().manual_seed(seed))


def _check(kwargs: dict, what: str) -> torch.Tensor:
    expected = SPEC.reference(**kwargs)
    poison_freed_memory(DEVICE, 4 * (kwargs["hidden"].numel() * kwargs["topk_ids"].shape[1] + 2 ** 20))
    actual = cuda_moe.fused_moe(**kwargs)
    try:
        SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
    return actual


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signature_matches_the_spec():
    assert inspect.signature(cuda_moe.fused_moe) == SPEC.signature


def _prefill_call(**options) -> dict:
    """512 tokens over 8 experts, top-2 (255 pairs per expert at the top of T's class): a call it takes."""
    tokens, experts, topk, hidden_size, inter_size = 512, 8, 2, options.pop("hidden", 64), 32
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **options)
    return make(torch.device("cpu"), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("call, platform, reason", [
    (dict(quantization="fp8_block", hidden=128), SM90, "fp8_block experts: 16-bit experts only"),
    (dict(quantization="mxfp4"), SM90, "mxfp4 experts: 16-bit experts only"),
    (dict(on_input=True), SM90, "apply_router_weight_on_input"),
    ({}, SM89, "needs sm_90 (Hopper: the GEMMs are built on its wgmma), this GPU is sm_89"),
    (dict(hidden=60), SM90, "H = 60: a multiple of 8 only"),
])
def test_declines_with_reasons(call, platform, reason):
    if call.get("on_input"):  # the spec allows the router weight on the input with top-1 only
        make = spec_module._maker(512, 8, 1, 64, 32, on_input=True)
        kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    else:
        kwargs = _prefill_call(**call)
    assert reason in ask(cuda_moe.supports, SPEC, kwargs, platform)


def test_takes_prefill_calls_and_leaves_decode_to_triton():
    assert ask(cuda_moe.supports, SPEC, _prefill_call(), SM90) is None
    assert ask(cuda_moe.supports, SPEC, _prefill_call(dtype=torch.float16, activation="gelu"), SM90) is None
    small = SPEC.case("qwen3_30b_a3b_t16_ep16").build("cpu", 0)  # 16 tokens x 8 over 128 experts
    assert "pairs per expert (T class 31) < 64" in ask(cuda_moe.supports, SPEC, small, SM90)


def test_declines_rows_it_cannot_copy_in_16_bytes():
    kwargs = _prefill_call()
    kwargs["w1"] = kwargs["w1"].transpose(1, 2).contiguous().transpose(1, 2)  # K strided
    assert "w1 needs a unit stride along its last dim" in ask(cuda_moe.supports, SPEC, kwargs, SM90)
    kwargs = _prefill_call()
    wide = torch.zeros(kwargs["hidden"].shape[0], 68, dtype=kwargs["hidden"].dtype)
    wide[:, :64] = kwargs["hidden"]
    kwargs["hidden"] = wide[:, :64]  # rows of 136 bytes: not 16-byte aligned
    assert "hidden needs a unit stride" in ask(cuda_moe.supports, SPEC, kwargs, SM90)


def test_weight_maps_give_k_rows_and_experts_innermost_first(monkeypatch):
    # The TMA map of w1 [E, 2I, H] (here with rows padded to H + 16) is (H, 2I, E) with byte strides
    # (row, expert), boxes of 64 of K by 128 rows by one expert.
    seen = []
    monkeypatch.setattr(_driver, "_encoded_map", lambda *args: seen.append(args) or bytes(128))
    w1 = torch.zeros(3, 2 * 40, 72 + 16, dtype=torch.bfloat16)[:, :, :72]
    _driver.tensor_map(w1, cuda_moe.B_BOX)
    assert seen == [(w1.data_ptr(), 2, (72, 80, 3), (88 * 2, 80 * 88 * 2), (64, 128, 1))]


def test_shared_memory_fits_hopper():
    for plan in PLANS:  # sm_90's opt-in limit per CTA, static (the mbarriers) and dynamic together
        assert cuda_moe.shared_bytes(plan.stages) + 16 * plan.stages <= 227 * 1024


def test_describe_names_the_plan_in_force():
    key = SPEC.validate(**_prefill_call())
    assert cuda_moe.describe(key, SM90).startswith("GEMMs of 128-row blocks x 2 x 128 columns, 4 stages of 48 KiB, "
                                                   "a CTA a tile")
    with cuda_moe.override_plan(stages=2, persistent=True):
        assert "2 stages of 48 KiB, one CTA an SM walking the tiles" in cuda_moe.describe(key, SM90)


def test_override_plan_checks_its_argument():
    with pytest.raises(ValueError, match="stages must be one of"):
        with cuda_moe.override_plan(stages=3):
            pass
    with pytest.raises(ValueError, match="persistent must be a bool"):
        with cuda_moe.override_plan(persistent=1):
            pass


@pytest.fixture(scope="module")
def sm90a_modules():
    modules = {}
    for bf16, gelu, stages in itertools.product((True, False), (False, True), cuda_moe.STAGES):
        names = cuda_moe.kernel_names(bf16, gelu, stages)
        modules[bf16, gelu, stages] = (names, _compile.compile_module(
            cuda_moe.source(names), list(names.values()), (9, 0), verbose=True, arch_specific=True))
    return modules


@needs_nvrtc
def test_kernels_compile_for_sm90a_without_spills(sm90a_modules):
    # The producer warpgroup gives registers to the consumers (setmaxnreg): both sides must fit their
    # share without spilling, and ptxas must not serialize the wgmmas.
    for (bf16, gelu, stages), (names, module) in sm90a_modules.items():
        for role, name in names.items():
            assert module.spill_bytes(name) == 0, name
            if role in ("gate_up", "down"):
                assert 0 < module.registers(name) <= 168, name  # 384 threads, one CTA per SM
                assert module.static_shared_bytes(name) == 16 * stages, name  # two mbarriers a stage
        assert "Performance Loss" not in module.log, module.log  # ptxas serialized wgmmas (C7514)
        assert "setmaxnreg" not in module.log, module.log  # ptxas says when it ignores it (C7508)


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU


@needs_hopper
@pytest.mark.parametrize("seed", (0, 7))
@pytest.mark.parametrize("name", SERVED)
def test_spec_cases_match_the_reference(name, seed):
    _check(SPEC.case(name).build(DEVICE, seed), f"{name} seed {seed}")


@needs_hopper
@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: f"stages{plan.stages}{'-persistent' * plan.persistent}")
@pytest.mark.parametrize("name", list(LARGE))
def test_prefill_sizes_match_the_reference(name, plan):
    with cuda_moe.override_plan(stages=plan.stages, persistent=plan.persistent):
        _check(_large(name, 3), name)


@needs_hopper
def test_padded_row_strides_and_strided_routing():
    kwargs = _large("ragged_h_and_i", 5)

    def padded(t: torch.Tensor, extra: int) -> torch.Tensor:  # rows 16-byte aligned, `extra` elements apart
        wide = torch.full((*t.shape[:-1], t.shape[-1] + extra), float("nan"), dtype=t.dtype, device=t.device)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]

    kwargs = dict(kwargs, hidden=padded(kwargs["hidden"], 8), w1=padded(kwargs["w1"], 16),
                  w2=padded(kwargs["w2"], 8), topk_weights=kwargs["topk_weights"].t().contiguous().t())
    ids = torch.zeros(kwargs["topk_ids"].shape[0], 2 * kwargs["topk_ids"].shape[1], dtype=torch.int32, device=DEVICE)
    ids[:, ::2] = kwargs["topk_ids"]
    kwargs["topk_ids"] = ids[:, ::2]
    _check(kwargs, "padded rows")


@needs_hopper
def test_a_captured_call_replays_on_new_routing():
    # No launch reads a device value on the host: a graph captured once serves new routing.
    kwargs = _large("map_holes_fp16", 0)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cuda_moe.fused_moe(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_moe.fused_moe(**static)
    fresh = _large("map_holes_fp16", 11)
    for k in ("hidden", "topk_weights", "topk_ids"):
        static[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    SPEC.check_close(out, SPEC.reference(**static), static)
