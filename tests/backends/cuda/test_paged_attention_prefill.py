"""The cuda backend's Hopper paged-attention prefill kernel: what it accepts and why not, how
paged_attention routes between it and the decode kernel, its compilation for sm_90a (NVRTC runs on
CPU-only machines), and on an sm_90 GPU every option, block size, GQA group, query dtype and
stage count against the spec's reference, with query tiles cut by sequence ends, chunked prefill
over cached context, decodes and empty sequences in the batch, NaN in unread cache slots,
NaN-poisoned output memory and CUDA-graph replays with new inputs."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import check_paged_attention, needs_cuobjdump, needs_hopper, needs_nvrtc, sass
from graph_replay import build, capture, replay_on_new_inputs
from fakes import ask
from kernelmux.backends.cuda import _compile, _toolchain
from kernelmux.backends.cuda._toolchain import KERNELS
from kernelmux.backends.cuda import _paged_prefill as prefill
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import paged_attention as pa_spec

SM90 = simulate("sm_90")

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
# Every plan the kernel is instantiated for: stages x (serial, overlap, overlap with ping-pong).
PLANS = [prefill.PrefillPlan(stages, overlap, pingpong) for stages in prefill.STAGES
         for overlap, pingpong in ((False, False), (True, False), (True, True))]
NAMES = [prefill.kernel_name(bf16, cap, plan) for bf16, cap, plan in
         itertools.product((True, False), (False, True), PLANS)]


# ---------------------------------------------------------------------------------------------
# Host side (any machine)

@pytest.mark.parametrize("kwargs, reason", [
    (dict(query_dtype=torch.float32, cache_dtype=torch.float32), "bf16 or fp16 queries only"),
    (dict(cache_dtype=FP8), "caches of the query's dtype (torch.bfloat16) only, this cache is "
                            "torch.float8_e4m3fn"),
    (dict(head_dim=64), "head dim 128 only (the tiles' layout), got 64"),
    (dict(block_size=24), "power-of-two cache block sizes only, got 24"),
])
def test_shape_reason_names_what_it_refuses(kwargs, reason):
    call = dict(query_dtype=BF16, cache_dtype=BF16, head_dim=128, block_size=16)
    assert prefill.shape_reason(**call) is None
    call.update(kwargs)
    assert reason in prefill.shape_reason(**call)


@pytest.mark.parametrize("dtype, block_size", [(BF16, 16), (FP16, 1), (BF16, 128), (FP16, 1024)])
def test_shape_reason_takes_prefill_shapes(dtype, block_size):
    assert prefill.shape_reason(dtype, dtype, 128, block_size) is None


def test_paged_attention_routes_by_max_query_len():
    # The host int max_query_len picks the kernel: > 1 asks the prefill kernel (here it declines
    # the fp8 cache by its own reason), <= 1 the decode kernel (which declines the bf16 cache).
    # Inputs on the CPU, answered for an H100 and an sm_100 GPU.
    fp8 = build(pa_spec._maker((5, 1), (9, 20), 8, 1, 128, cache_dtype=FP8), 0, "cpu")
    assert "caches of the query's dtype" in ask(cuda_paged_attention.supports, pa_spec.SPEC, fp8, SM90)
    same = build(pa_spec._maker((1, 1), (9, 20), 8, 1, 128), 0, "cpu")
    assert "fp8 e4m3 caches only" in ask(cuda_paged_attention.supports, pa_spec.SPEC, same, SM90)
    prefill_call = build(pa_spec._maker((5, 1), (9, 20), 8, 1, 128), 0, "cpu")
    assert ask(cuda_paged_attention.supports, pa_spec.SPEC, prefill_call, SM90) is None
    assert "prefill needs sm_90" in ask(cuda_paged_attention.supports, pa_spec.SPEC, prefill_call,
                                        simulate("sm_100"))


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_prefill_declines_scales_it_cannot_fold(scale):
    # The kernel scales each row's raw maximum once, which needs a positive scale (the spec
    # refuses non-finite ones).
    call = build(pa_spec._maker((5, 1), (9, 20), 8, 1, 128), 0, "cpu")
    call["scale"] = scale
    reason = ask(cuda_paged_attention.supports, pa_spec.SPEC, call, SM90)
    assert reason == f"prefill: scale must be finite and > 0, got {scale}"


def test_override_plan_checks_its_argument():
    with pytest.raises(ValueError, match=r"stages must be one of \(2, 3\), got 4"):
        with prefill.override_plan(stages=4):
            pass
    with pytest.raises(ValueError, match="overlap must be a bool, got 1"):
        with prefill.override_plan(overlap=1):
            pass
    with pytest.raises(ValueError, match="pingpong needs overlap"):
        with prefill.override_plan(overlap=False, pingpong=True):
            pass
    with prefill.override_plan(stages=3, overlap=False, pingpong=False):
        assert prefill._plans.current == prefill.PrefillPlan(stages=3, overlap=False, pingpong=False)
    assert prefill._plans.current == prefill.DEFAULT_PLAN


def test_dynamic_shared_memory_matches_the_kernel():
    # The kernel traps when launched with less than its shared_bytes<STAGES>(), which the GPU
    # tests would show; the host's formula is the kernel's.
    source = (KERNELS / prefill.SOURCE_NAME).read_text()
    assert "constexpr int shared_bytes() { return (1 + 2 * STAGES) * kTile + 1024; }" in source
    for stages in prefill.STAGES:
        assert prefill.shared_bytes(stages) == (1 + 2 * stages) * 128 * 128 * 2 + 1024


@pytest.fixture(scope="module")
def sm90a_module():
    """Every instantiation, compiled once for sm_90a (NVRTC runs without a GPU)."""
    return _compile.compile_module(prefill.source(NAMES), NAMES, (9, 0), verbose=True, arch_specific=True)


@needs_nvrtc
def test_kernels_compile_for_sm90a_without_spills(sm90a_module):
    # The producer warpgroup gives registers to the consumers (setmaxnreg): both sides must fit
    # their share without spilling, and ptxas must not serialize the wgmmas.
    module = sm90a_module
    for name, plan in zip(NAMES, itertools.cycle(PLANS)):
        assert module.spill_bytes(name) == 0, name
        assert 0 < module.registers(name) <= 168, name  # 384 threads, one CTA per SM
        # sm_90's opt-in limit per CTA is 227 KiB, static (the mbarriers) and dynamic together.
        static = module.static_shared_bytes(name)
        assert static == 32 * plan.stages, (name, static)
        assert static + prefill.shared_bytes(plan.stages) <= 227 * 1024, name
    # ptxas serializes wgmmas it cannot pair with their waits (C7514 "Potential Performance
    # Loss"): a wgmma issued under a branch inside the overlapped loop did that once.
    assert "Performance Loss" not in module.log, module.log
    assert "setmaxnreg" not in module.log, module.log  # ptxas says when it ignores it (C7508)


@needs_nvrtc
def test_watchdog_build_compiles():
    # KERNELMUX_DIAG_WATCHDOG (sm90_common.cuh) makes an mbarrier wait stuck for 2 s print and trap:
    # the diagnostic build for a changed barrier protocol on the GPU must keep compiling (it may
    # spill and serialize wgmmas: it is for finding hangs, not for timing).
    name = prefill.kernel_name(True, False, prefill.DEFAULT_PLAN)
    watched = _compile.compile_module(prefill.source([name]), [name], (9, 0), arch_specific=True,
                                    defines=("KERNELMUX_DIAG_WATCHDOG",))
    plain = _compile.compile_module(prefill.source([name]), [name], (9, 0), arch_specific=True)
    assert "vprintf" in watched.cubin.decode("latin-1")  # the watchdog's report is compiled in
    assert "vprintf" not in plain.cubin.decode("latin-1")


@needs_nvrtc
@needs_cuobjdump
def test_overlapped_softmax_is_scheduled_under_the_value_mmas(sm90a_module):
    # With overlap, each step waits for its scores (wait_group 1), computes the softmax, then waits
    # for the previous step's value MMAs (wait_group 0). ptxas once hoisted that second wait above
    # the exponentials (702165d), so the softmax ran after the MMAs: the SASS must keep a step's
    # exponentials (64 a thread, more with the soft cap) between the two waits.
    kernels = sass(sm90a_module.cubin)
    overlapped = [name for name, plan in zip(NAMES, itertools.cycle(PLANS)) if plan.overlap]
    assert len(overlapped) == 16
    for name in overlapped:
        code = kernels[sm90a_module.names[name]]
        scores_waits = [i for i, ins in enumerate(code) if ins == "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
        assert scores_waits, name  # the overlapped loop's wait for the scores
        for start in scores_waits:
            end = next(i for i in range(start, len(code)) if code[i] == "WARPGROUP.DEPBAR.LE gsb0, 0x0")
            exponentials = sum("MUFU.EX2" in ins for ins in code[start:end])
            assert exponentials >= 64, (name, exponentials)


@needs_nvrtc
def test_sm90_without_the_arch_suffix_is_refused_by_ptxas():
    with pytest.raises(_toolchain.NvrtcError, match="sm_90"):
        _compile.compile_module(prefill.source(NAMES[:1]), NAMES[:1], (9, 0))


# ---------------------------------------------------------------------------------------------
# The kernel (sm_90 GPU)

OPTIONS = {
    "causal": {},
    "non_causal": {"causal": False},
    "window": {"sliding_window": 70},
    "wide_window": {"sliding_window": 300},
    "sinks_cap": {"with_sinks": True, "logits_soft_cap": 2.0, "scale": 0.5},
    "window_sinks_cap_fp16": {"sliding_window": 129, "with_sinks": True, "logits_soft_cap": 30.0,
                              "dtype": FP16},
}
# One batch with: a prompt ending inside a query tile, a chunk starting part-way into its
# sequence (its context not a multiple of a step), a prompt of exactly one tile, a sequence
# without queries, a decode, a query over a single position, and a chunk of 300 queries over
# 1029 positions (three tiles, the first two far from the diagonal).
Q_LENS, KV_LENS = (200, 77, 128, 0, 1, 1, 300), (200, 333, 128, 9, 45, 1, 1029)


@needs_hopper
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 1), (32, 8), (4, 4)])
def test_prefill_against_reference(options, block_size, num_heads, num_kv_heads):
    seed = 100 * block_size + num_heads
    q_lens, kv_lens = Q_LENS, KV_LENS
    if "causal" in OPTIONS[options]:  # non-causal: queries need not fit their sequence
        q_lens, kv_lens = Q_LENS + (150,), KV_LENS + (20,)
    make = pa_spec._maker(q_lens, kv_lens, num_heads, num_kv_heads, 128, block_size=block_size,
                          **OPTIONS[options])
    check_paged_attention(build(make, seed, DEVICE), seed, poison=True)


@needs_hopper
@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("options", ["causal", "window_sinks_cap_fp16", "non_causal"])
def test_every_plan_against_reference(plan, options):
    # Sequences of one step, of 8 and 12 steps (a chunk starting at 987), a decode among them.
    make = pa_spec._maker((1000, 513, 64, 1), (1000, 1500, 64, 300), 8, 2, 128, **OPTIONS[options])
    with prefill.override_plan(**dataclasses.asdict(plan)):
        check_paged_attention(build(make, plan.stages, DEVICE), plan.stages, poison=True)


@needs_hopper
def test_prefill_ignores_nan_in_unread_slots():
    block = 16
    kwargs = build(pa_spec._maker((13, 40, 130), (13, 77, 200), 8, 1, 128, block_size=block, spare_blocks=4),
                   7, DEVICE)
    expected = pa_spec.SPEC.reference(**kwargs)
    read = torch.zeros(kwargs["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    for b, length in enumerate(kwargs["seq_lens"].tolist()):
        for j in range(length):
            read[kwargs["block_table"][b, j // block], j % block] = True
    for name in ("k_cache", "v_cache"):
        kwargs[name][~read] = float("nan")
    for plan in PLANS:
        with prefill.override_plan(**dataclasses.asdict(plan)):
            pa_spec.SPEC.check_close(cuda_paged_attention.paged_attention(**kwargs), expected, kwargs)


@needs_hopper
def test_llama3_prefill_shape_against_reference():
    # The perf goal's shape, shortened: one causal prompt of 2048 tokens, 32 / 8 heads.
    make = pa_spec._maker((2048,), (2048,), 32, 8, 128)
    check_paged_attention(build(make, 5, DEVICE), 5, poison=True)


@needs_hopper
def test_misaligned_query_view_is_refused_by_name():
    kwargs = build(pa_spec._maker((40,), (40,), 8, 1, 128), 1, DEVICE)
    wide = torch.zeros(kwargs["query"].shape[:-1] + (136,), dtype=BF16, device=DEVICE)
    kwargs["query"] = wide[..., 4:132]
    reason = ask(cuda_paged_attention.supports, pa_spec.SPEC, kwargs)
    assert reason is not None and reason.startswith("query needs a unit stride along the head dim and 16-byte")
    # Dispatch decides per key, which holds the layout: the call goes elsewhere, and is right.
    expected = pa_spec.SPEC.reference(**kwargs)
    engine = Engine(ALL_SPECS, Settings())
    pa_spec.SPEC.check_close(engine.dispatchers["paged_attention"](**kwargs), expected, kwargs)
    (decision,) = engine.dispatchers["paged_attention"].decisions.values()
    assert decision.backend != "cuda" and dict(decision.answers)["cuda"] == reason


@needs_hopper
def test_prefill_graph_replays_new_inputs():
    # Captured with 150 queries per sequence; replays change the lengths (each at least its query
    # count: causal), the table, queries and caches.
    batch, max_len, q_len = 4, 700, 150
    make = pa_spec._maker((q_len,) * batch, (max_len,) * batch, 8, 2, 128, spare_blocks=64)
    static = build(make, 0, DEVICE)
    graph, out = capture(cuda_paged_attention.paged_attention, static)
    replay_on_new_inputs(pa_spec, make, static, graph, out, batch, max_len, min_len=q_len)
