"""The cuda backend's Hopper fused_moe: what it accepts and why not, its compilation (the GEMMs for sm_90a, the
decode GEMVs for sm_80 and sm_90; NVRTC runs on CPU-only machines) without spills, and on an sm_90 GPU against
the spec's reference: every 16-bit case each route computes (called directly, the route forced by the plan:
supports' floor on pairs per expert and the GEMVs' T = 1 are selection policies, not limits of the kernels),
runs of several 128-row blocks, H and I off the 64-wide K steps and 128-wide column tiles, the GEMVs' whole
batches of loads and their tails, rows of fewer pieces than a warp's lanes, experts on other ranks, top-1, the
router weight on the input (GEMVs), fp16 and gelu, every plan, padded row strides, NaN-poisoned memory, and
CUDA-graph replays on new routing; the fp8_block experts' GEMMs on the same terms (down's last column tile past H,
the weights' scales strided, zero groups of the intermediate); and the fp4 (MXFP4, NVFP4) experts' decode GEMVs
on the same terms, with every code at the bit placement's subnormal (+-0.5) and the scales' extremes (e8m0 codes
past the one-multiply range and NaN; e4m3 subnormal, maximum and NaN)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import needs_hopper, needs_nvrtc
from fakes import ask, check_against_reference
from kernelmux.backends.cuda import _compile, _driver
from kernelmux.backends.cuda import fused_moe as cuda_moe
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
# fp8_block experts (the GEMMs; H and I multiples of 128): the spec's cases they take, and runs of several blocks,
# K of one step, down's last 256-column tile half past H (H 384), fp16 and gelu with a map with holes, top-1.
FP8 = {"quantization": "fp8_block"}
FP8_SERVED = ["deepseek_v3_t16_fp8_block_ep256", "small_fp8_block"]
FP8_LARGE = {
    "fp8_runs_of_several_blocks": (600, 4, 2, 256, 256, FP8),
    "fp8_one_step_h_past_half_tile": (300, 6, 3, 128, 384, FP8),
    "fp8_h_past_half_tile": (300, 6, 3, 384, 128, {**FP8, "activation": "gelu"}),
    "fp8_map_holes_fp16": (257, 12, 3, 256, 256, {**FP8, "unmapped": 5, "dtype": torch.float16}),
    "fp8_top1_with_a_map": (400, 8, 1, 512, 128, {**FP8, "local_experts": 4}),
}
# The decode GEMVs' sizes: gate-up's whole 1024-element batches of K and a tail (H 4616: four and 520), down's
# (slot, piece) walk over rows of 96 and 545 pieces and of fewer than a warp's 32 (several slots a step), top-k up
# to a warp's 32 lanes.
DECODE = {
    "qwen3_rows": (1, 16, 8, 2048, 768, {}),
    "long_rows": (1, 6, 2, 4616, 4360, {}),
    "ragged_gelu": (1, 12, 6, 1160, 200, {"activation": "gelu"}),
    "map_holes_fp16": (1, 40, 8, 520, 96, {"unmapped": 12, "dtype": torch.float16}),
    "top1_on_input": (1, 8, 1, 1032, 64, {"on_input": True}),
    "top32_short_rows": (1, 40, 32, 256, 8, {}),
    "three_tokens": (3, 8, 4, 1160, 136, {}),  # T > 1 under the plan: pairs that share an expert
    "many_tokens_on_input": (200, 8, 1, 72, 40, {"on_input": True, "local_experts": 4}),
}
# fp4 experts (the decode GEMVs): the spec's fp4 cases they take (the two NVFP4 ones have I = 48 and 16, not a
# multiple of the 32 codes a lane loads), and sizes beyond them: gpt-oss's rows (2880: 22 whole 128-wide steps
# and half of one), whole steps only, NVFP4 with bf16 and fp16, a map with holes, the router weight on the
# input, top-32, several tokens.
FP4_SERVED = ["gpt_oss_120b_t8_mxfp4_ep32", "small_mxfp4", "mxfp4_expert_map_holes"]
FP4_DECODE = {
    "gpt_oss_rows": (1, 16, 4, 2880, 2880, {"quantization": "mxfp4"}),
    "nvfp4_whole_steps": (1, 8, 2, 1024, 256, {"quantization": "nvfp4"}),
    "nvfp4_fp16_gelu": (1, 12, 6, 608, 96, {"quantization": "nvfp4", "dtype": torch.float16, "activation": "gelu"}),
    "mxfp4_map_holes": (1, 40, 8, 544, 160, {"quantization": "mxfp4", "unmapped": 12}),
    "nvfp4_top1_on_input": (1, 8, 1, 1056, 64, {"quantization": "nvfp4", "on_input": True}),
    "mxfp4_top32": (1, 40, 32, 256, 32, {"quantization": "mxfp4"}),
    "three_tokens_nvfp4": (3, 8, 4, 1184, 160, {"quantization": "nvfp4"}),
}


def _large(name: str, seed: int, sizes: dict = LARGE) -> dict:
    tokens, experts, topk, hidden_size, inter_size, options = sizes[name]
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **options)
    return make(torch.device(DEVICE), torch.Generator().manual_seed(seed))


def _check(kwargs: dict, what: str) -> torch.Tensor:
    pairs_bytes = 4 * (kwargs["hidden"].numel() * kwargs["topk_ids"].shape[1] + 2 ** 20)
    return check_against_reference(SPEC, cuda_moe.fused_moe, kwargs, what, pairs_bytes)


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signature_matches_the_spec():
    assert inspect.signature(cuda_moe.fused_moe) == SPEC.signature


def _prefill_call(**options) -> dict:
    """512 tokens over 8 experts, top-2 (255 pairs per expert at the top of T's class): a call it takes."""
    tokens, experts, topk = 512, 8, 2
    hidden_size, inter_size = options.pop("hidden", 64), options.pop("inter", 32)
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **options)
    return make(torch.device("cpu"), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("call, platform, reason", [
    (dict(quantization="fp8_per_tensor"), SM90, "fp8_per_tensor experts: 16-bit, fp8_block and fp4 experts only"),
    (dict(quantization="fp8_block", hidden=128), SM90, "I = 32: fp8_block experts need a multiple of 128"),
    (dict(quantization="fp8_block", hidden=200, inter=128), SM90, "H = 200: fp8_block experts need a multiple"),
    (dict(quantization="fp8_block", fp8_name="e4m3fnuz", hidden=128, inter=128), SM90,
     "fp8_block experts in torch.float8_e4m3fnuz: e4m3fn only"),
    (dict(quantization="mxfp4"), SM90, "mxfp4 experts above T = 1: only the decode GEMVs decode fp4 weights"),
    (dict(on_input=True), SM90, "apply_router_weight_on_input above T = 1"),
    ({}, SM89, "needs sm_90 (Hopper: the GEMMs are built on its wgmma"),
    (dict(hidden=60), SM90, "H = 60: a multiple of 8 only"),
])
def test_declines_with_reasons(call, platform, reason):
    if call.get("on_input"):  # the spec allows the router weight on the input with top-1 only
        make = spec_module._maker(512, 8, 1, 64, 32, on_input=True)
        kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    else:
        kwargs = _prefill_call(**call)
    assert reason in ask(cuda_moe.supports, SPEC, kwargs, platform)


def test_takes_prefill_calls_and_t1_and_leaves_decode_batches_to_triton():
    assert ask(cuda_moe.supports, SPEC, _prefill_call(), SM90) is None
    assert ask(cuda_moe.supports, SPEC, _prefill_call(dtype=torch.float16, activation="gelu"), SM90) is None
    fp8 = _prefill_call(quantization="fp8_block", hidden=256, inter=128)
    assert ask(cuda_moe.supports, SPEC, fp8, SM90) is None
    assert "e4m3 wgmmas promoted per 128-K block" in cuda_moe.describe(SPEC.validate(**fp8), SM90)
    small = SPEC.case("qwen3_30b_a3b_t16_ep16").build("cpu", 0)  # 16 tokens x 8 over 128 experts
    assert "pairs per expert (T class 31) < 64" in ask(cuda_moe.supports, SPEC, small, SM90)
    for name in ("qwen3_rows", "top1_on_input", "top32_short_rows"):  # T = 1: the decode GEMVs
        assert ask(cuda_moe.supports, SPEC, _decode_call(name), SM90) is None, name


def _decode_call(name: str, **options) -> dict:
    tokens, experts, topk, hidden_size, inter_size, base = DECODE[name]
    make = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **{**base, **options})
    return make(torch.device("cpu"), torch.Generator().manual_seed(0))


def test_decode_declines_what_its_warps_cannot_hold():
    make = spec_module._maker(1, 40, 33, 64, 32)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert "top-k = 33 > 32: the down GEMV holds a slot a lane" in ask(cuda_moe.supports, SPEC, kwargs, SM90)
    assert "fp8_per_tensor experts: 16-bit, fp8_block and fp4 experts only" in ask(
        cuda_moe.supports, SPEC, _decode_call("qwen3_rows", quantization="fp8_per_tensor"), SM90)
    assert "fp8_block experts at T = 1: the decode GEMVs take 16-bit and fp4 experts" in ask(
        cuda_moe.supports, SPEC, _decode_call("qwen3_rows", quantization="fp8_block"), SM90)
    assert "needs sm_90" in ask(cuda_moe.supports, SPEC, _decode_call("qwen3_rows"), SM89)


def test_decode_takes_fp4_experts_it_can_load():
    for name in ("gpt_oss_rows", "nvfp4_fp16_gelu", "mxfp4_top32"):
        tokens, experts, topk, hidden_size, inter_size, options = FP4_DECODE[name]
        experts = max(topk, 4)  # supports reads shapes, not values: few experts keep quantizing them on the CPU cheap
        kwargs = spec_module._maker(tokens, experts, topk, hidden_size, inter_size, **options)(
            torch.device("cpu"), torch.Generator().manual_seed(0))
        assert ask(cuda_moe.supports, SPEC, kwargs, SM90) is None, name
    for hidden_size, inter_size, name in ((64, 48, "I = 48"), (80, 64, "H = 80")):
        kwargs = spec_module._maker(1, 6, 3, hidden_size, inter_size, quantization="nvfp4")(
            torch.device("cpu"), torch.Generator().manual_seed(0))
        assert f"{name}: fp4 experts need a multiple of 32" in ask(cuda_moe.supports, SPEC, kwargs, SM90)
    mxfp4_fp16 = _decode_call("qwen3_rows", quantization="mxfp4", dtype=torch.float16)
    assert "MXFP4 experts with fp16 activations" in ask(cuda_moe.supports, SPEC, mxfp4_fp16, SM90)
    assert cuda_moe.describe(SPEC.validate(**mxfp4_fp16), SM90).startswith("decode GEMVs of mxfp4 experts on the "
                                                                            "tensor cores")


@needs_hopper
def test_forced_gemvs_refuse_a_topk_past_a_warp():
    kwargs = spec_module._maker(2, 40, 33, 64, 32)(torch.device(DEVICE), torch.Generator().manual_seed(0))
    with cuda_moe.override_plan(gemv=True), pytest.raises(ValueError, match="top-k <= 32, got 33"):
        cuda_moe.fused_moe(**kwargs)


@pytest.mark.parametrize("inter_size, options, reason", [
    (64, {"quantization": "mxfp4", "dtype": torch.float16}, "MXFP4 experts with fp16 activations"),
    (48, {"quantization": "nvfp4"}, "I = 48: fp4 experts need a multiple of 32"),
])
def test_fp4_gemvs_refuse_what_they_cannot_compute(inter_size, options, reason):
    # supports declines these; a direct call is refused before anything launches (so on any machine).
    kwargs = spec_module._maker(1, 6, 3, 64, inter_size, **options)(torch.device("cpu"),
                                                                     torch.Generator().manual_seed(0))
    assert reason in ask(cuda_moe.supports, SPEC, kwargs, SM90)
    with pytest.raises(ValueError, match=reason):
        cuda_moe.fused_moe(**kwargs)


def test_gemv_grids_give_every_warp_the_same_tasks(monkeypatch):
    class Resident:  # a kernel of which `blocks_per_sm` 8-warp CTAs fit an SM
        def __init__(self, blocks_per_sm: int) -> None:
            self.blocks_per_sm = blocks_per_sm

    monkeypatch.setattr(cuda_moe, "_sm_count", lambda device: 132)
    # Qwen3 T 1 gate-up: 6144 tasks over 5 x 132 x 8 resident warps -> 2 a warp, 384 CTAs (not 660 CTAs of
    # which 864 warps would run a second task while the rest idle).
    assert cuda_moe._gemv_grid(Resident(5), None, 6144) == (384, 1, 1)
    assert cuda_moe._gemv_grid(Resident(2), None, 2048) == (256, 1, 1)  # down: one task a warp
    assert cuda_moe._gemv_grid(Resident(2), None, 2113) == (133, 1, 1)  # one past the resident warps: 2 a warp
    assert cuda_moe._gemv_grid(Resident(2), None, 3) == (1, 1, 1)


def test_decode_leaves_large_experts_to_triton():
    def t1(experts: int, topk: int, hidden_size: int, inter_size: int) -> dict:  # shapes only: a key, no data
        meta = dict(dtype=torch.bfloat16, device="meta")
        return dict(hidden=torch.empty(1, hidden_size, **meta),
                    w1=torch.empty(experts, 2 * inter_size, hidden_size, **meta),
                    w2=torch.empty(experts, hidden_size, inter_size, **meta),
                    topk_weights=torch.empty(1, topk, device="meta"),
                    topk_ids=torch.empty(1, topk, dtype=torch.int32, device="meta"))

    assert ask(cuda_moe.supports, SPEC, t1(128, 8, 2048, 768), SM90) is None  # Qwen3-30B-A3B: 72 MiB
    assert "T = 1 over 672 MiB of routed weights > 256 MiB" in ask(cuda_moe.supports, SPEC, t1(8, 2, 4096, 14336),
                                                                    SM90)  # Mixtral-8x7B


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
    decode = SPEC.validate(**_decode_call("qwen3_rows"))
    assert cuda_moe.describe(decode, SM90).startswith("decode GEMVs: gate-up a warp a (pair, column)")
    with cuda_moe.override_plan(gemv=False):
        assert cuda_moe.describe(decode, SM90).startswith("GEMMs of 128-row blocks")
    with cuda_moe.override_plan(gemv=True):
        assert cuda_moe.describe(key, SM90).startswith("decode GEMVs")


def test_override_plan_checks_its_argument():
    with pytest.raises(ValueError, match="stages must be one of"):
        with cuda_moe.override_plan(stages=3):
            pass
    with pytest.raises(ValueError, match="persistent must be a bool"):
        with cuda_moe.override_plan(persistent=1):
            pass
    with pytest.raises(ValueError, match="gemv must be None or a bool, got 1"):
        with cuda_moe.override_plan(gemv=1):
            pass


@needs_nvrtc
def test_fp4_decode_gemvs_compile_without_spills():
    # Hopper only (cvt from e4m3 needs sm_89; the registration is sm_90). Gate-up's 128 threads and down's 256
    # at most 128 registers: four and two CTAs on an SM.
    for quantization, bf16, gelu in itertools.product(cuda_moe.FP4_QUANTIZATIONS, (True, False), (False, True)):
        if quantization == "mxfp4" and not bf16:
            continue  # declined: e8m0 scales leave fp16's range
        names = cuda_moe.decode_kernel_names(bf16, gelu, quantization)
        module = _compile.compile_module(cuda_moe.decode_source(names, quantization), list(names.values()), (9, 0),
                                         verbose=True)
        for name in names.values():
            assert module.spill_bytes(name) == 0, name
            assert 0 < module.registers(name) <= 128, name


@pytest.fixture(scope="module")
def sm90a_modules():
    modules = {}
    for bf16, gelu, stages, fp8 in itertools.product((True, False), (False, True), cuda_moe.STAGES, (False, True)):
        names = cuda_moe.kernel_names(bf16, gelu, stages, fp8)
        modules[bf16, gelu, stages, fp8] = (names, _compile.compile_module(
            cuda_moe.source(names), list(names.values()), (9, 0), verbose=True, arch_specific=True))
    return modules


@needs_nvrtc
def test_kernels_compile_for_sm90a_without_spills(sm90a_modules):
    # The producer warpgroup gives registers to the consumers (setmaxnreg): both sides must fit their
    # share without spilling, and ptxas must not serialize the wgmmas.
    for (bf16, gelu, stages, fp8), (names, module) in sm90a_modules.items():
        for role, name in names.items():
            assert module.spill_bytes(name) == 0, name
            if role in ("gate_up", "down"):
                assert 0 < module.registers(name) <= 168, name  # 384 threads, one CTA per SM
                assert module.static_shared_bytes(name) == 16 * stages, name  # two mbarriers a stage
        assert "Performance Loss" not in module.log, module.log  # ptxas serialized wgmmas (C7514)
        assert "setmaxnreg" not in module.log, module.log  # ptxas says when it ignores it (C7508)


@needs_nvrtc
@pytest.mark.parametrize("arch", [(8, 0), (9, 0)])
def test_decode_gemvs_compile_without_spills(arch):
    # 256 threads: at most 128 registers keeps two CTAs (16 warps of loads in flight) on an SM.
    for bf16, gelu in itertools.product((True, False), (False, True)):
        names = cuda_moe.decode_kernel_names(bf16, gelu)
        module = _compile.compile_module(cuda_moe.decode_source(names), list(names.values()), arch, verbose=True)
        for name in names.values():
            assert module.spill_bytes(name) == 0, name
            assert 0 < module.registers(name) <= 128, name


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU


@needs_hopper
@pytest.mark.parametrize("gemv", (False, True), ids=("gemms", "gemvs"))
@pytest.mark.parametrize("seed", (0, 7))
@pytest.mark.parametrize("name", SERVED)
def test_spec_cases_match_the_reference(name, seed, gemv):
    with cuda_moe.override_plan(gemv=gemv):
        _check(SPEC.case(name).build(DEVICE, seed), f"{name} seed {seed}{', GEMVs' * gemv}")


@needs_hopper
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_sizes_match_the_reference(name):
    with cuda_moe.override_plan(gemv=True):
        _check(_large(name, 3, DECODE), name)


@needs_hopper
def test_t1_takes_the_gemvs_unless_the_plan_says_otherwise(monkeypatch):
    kwargs = _large("qwen3_rows", 1, DECODE)
    routes = []
    monkeypatch.setattr(cuda_moe, "_fused_moe_decode",
                        lambda *args, real=cuda_moe._fused_moe_decode: routes.append("gemv") or real(*args))
    _check(kwargs, "T = 1")
    assert routes == ["gemv"]
    with cuda_moe.override_plan(gemv=False):
        _check(kwargs, "T = 1 by the GEMMs")
    assert routes == ["gemv"]


@needs_hopper
@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: f"stages{plan.stages}{'-persistent' * plan.persistent}")
@pytest.mark.parametrize("name", [*LARGE, *FP8_LARGE])
def test_prefill_sizes_match_the_reference(name, plan):
    with cuda_moe.override_plan(stages=plan.stages, persistent=plan.persistent):
        _check(_large(name, 3, {**LARGE, **FP8_LARGE}), name)


@needs_hopper
@pytest.mark.parametrize("seed", (0, 7))
@pytest.mark.parametrize("name", FP8_SERVED)
def test_fp8_spec_cases_match_the_reference(name, seed):
    _check(SPEC.case(name).build(DEVICE, seed), f"{name} seed {seed}")


def _padded(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t in rows `extra` elements longer (NaN past t's: never read), as a view of t's shape."""
    wide = t.new_empty((*t.shape[:-1], t.shape[-1] + extra))
    wide.view(torch.uint8).fill_(0xFF)  # NaN in bf16, fp16 and e4m3fn alike
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


@needs_hopper
def test_fp8_strided_scales_padded_rows_and_zero_groups():
    kwargs = _large("fp8_runs_of_several_blocks", 5, FP8_LARGE)
    kwargs["hidden"][:, :128] = 0  # every token's first input group zero: the amax floor's scale
    kwargs["w1"][1, :128] = 0  # expert 1's first 128 gate columns: a zero group of the intermediate for its rows
    kwargs = dict(kwargs, hidden=_padded(kwargs["hidden"], 16), w1=_padded(kwargs["w1"], 32),
                  w2=_padded(kwargs["w2"], 16),
                  w1_scale=kwargs["w1_scale"].transpose(1, 2).contiguous().transpose(1, 2),
                  w2_scale=kwargs["w2_scale"].permute(2, 1, 0).contiguous().permute(2, 1, 0))
    _check(kwargs, "fp8: strided scales, padded rows, zero groups")


def test_fp8_gemms_refuse_what_they_cannot_compute():
    # supports declines these; a direct call is refused before anything launches (so on any machine).
    for name, reason in (("fp8_block_h_i_not_multiple_of_128", "H = 200: fp8_block experts need a multiple of 128"),
                         ("small_fp8_block_fnuz_gelu", "e4m3fn only")):
        with pytest.raises(ValueError, match=reason):
            cuda_moe.fused_moe(**SPEC.case(name).build("cpu", 0))
    kwargs = _prefill_call(quantization="fp8_block", hidden=256, inter=128)
    with cuda_moe.override_plan(gemv=True), pytest.raises(ValueError, match="fp8_block experts run the GEMMs only"):
        cuda_moe.fused_moe(**kwargs)
    with pytest.raises(ValueError, match="16-bit, fp8_block or fp4 experts, got fp8_per_tensor"):
        cuda_moe.fused_moe(**_prefill_call(quantization="fp8_per_tensor"))
    kwargs = spec_module._maker(512, 8, 1, 64, 32, on_input=True)(torch.device("cpu"), torch.Generator().manual_seed(0))
    with cuda_moe.override_plan(gemv=False), pytest.raises(ValueError, match="apply_router_weight_on_input"):
        cuda_moe.fused_moe(**kwargs)


@needs_hopper
@pytest.mark.parametrize("gemv", (False, True))
def test_padded_row_strides_and_strided_routing(gemv):
    kwargs = _large("ragged_h_and_i", 5)
    kwargs = dict(kwargs, hidden=_padded(kwargs["hidden"], 8), w1=_padded(kwargs["w1"], 16),
                  w2=_padded(kwargs["w2"], 8), topk_weights=kwargs["topk_weights"].t().contiguous().t())
    ids = torch.zeros(kwargs["topk_ids"].shape[0], 2 * kwargs["topk_ids"].shape[1], dtype=torch.int32, device=DEVICE)
    ids[:, ::2] = kwargs["topk_ids"]
    kwargs["topk_ids"] = ids[:, ::2]
    with cuda_moe.override_plan(gemv=gemv):
        _check(kwargs, "padded rows")


@needs_hopper
@pytest.mark.parametrize("name, sizes", [("map_holes_fp16", LARGE), ("map_holes_fp16", DECODE),
                                         ("fp8_map_holes_fp16", FP8_LARGE)], ids=("gemms", "gemvs", "fp8-gemms"))
def test_a_captured_call_replays_on_new_routing(name, sizes):
    # No launch reads a device value on the host: a graph captured once serves new routing.
    kwargs = _large(name, 0, sizes)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cuda_moe.fused_moe(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_moe.fused_moe(**static)
    fresh = _large(name, 11, sizes)
    for k in ("hidden", "topk_weights", "topk_ids"):
        static[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    SPEC.check_close(out, SPEC.reference(**static), static)


@needs_hopper
@pytest.mark.parametrize("seed", (0, 7))
@pytest.mark.parametrize("name", FP4_SERVED)
def test_fp4_spec_cases_match_the_reference(name, seed):
    kwargs = SPEC.case(name).build(DEVICE, seed)
    with cuda_moe.override_plan(gemv=True):  # T above 1: supports' policy, not the kernels' limit
        _check(kwargs, f"{name} seed {seed}")
    with cuda_moe.override_plan(gemv=False), pytest.raises(ValueError, match="run the decode GEMVs only"):
        cuda_moe.fused_moe(**kwargs)


@needs_hopper
@pytest.mark.parametrize("name", list(FP4_DECODE))
def test_fp4_decode_sizes_match_the_reference(name):
    _check(_large(name, 3, FP4_DECODE), name)


@needs_hopper
@pytest.mark.parametrize("quantization", cuda_moe.FP4_QUANTIZATIONS)
def test_fp4_subnormal_codes_and_extreme_scales(quantization):
    # Every code of w1 is +-0.5, which the bit placement makes a 16-bit subnormal: flushed, gate and up would be 0.
    # w2's scales take the extremes: MXFP4 codes 0, 128 (the last of one multiply), 200 (two) and 0xFF (NaN: those
    # columns of the output NaN); NVFP4 e4m3 0x01 (subnormal 2^-9), 0x7E (448) and 0x7F (NaN).
    kwargs = _large("gpt_oss_rows" if quantization == "mxfp4" else "nvfp4_whole_steps", 5, FP4_DECODE)
    kwargs["w1"].fill_(0x91)
    scale = kwargs["w2_scale"].view(torch.uint8)
    extremes = (0, 128, 200, 0xFF) if quantization == "mxfp4" else (0x01, 0x7E, 0x01, 0x7F)
    for row, code in zip((0, 9, 18, 27), extremes):
        scale[:, row, 1] = code
    out = _check(kwargs, f"{quantization} extremes")
    assert out[:, 27].isnan().all() and not out[:, :27].isnan().any()
