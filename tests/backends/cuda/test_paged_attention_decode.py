"""The cuda backend's fp8 paged-attention decode kernel: what it accepts and why not, its split
heuristic, its compilation for the GPU archs it claims (NVRTC runs on CPU-only machines), and
on a GPU every option, block size, GQA group and split count against the spec's reference,
NaN in unread cache slots, queries past fp16's range and CUDA-graph replays with new inputs."""

from __future__ import annotations

import ctypes
import itertools
import re
import threading

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import check_paged_attention, needs_gpu, needs_nvrtc
from graph_replay import build, capture, replay_on_new_inputs
from fakes import ask
from kernelmux.backends.cuda import _compile, _driver, _paged_decode, _toolchain
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.registry import Registry

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# Host side (any machine)

@pytest.mark.parametrize("kwargs, reason", [
    (dict(decode=False), "decode only"),
    (dict(cache_dtype=torch.bfloat16), "fp8 e4m3 caches only"),
    (dict(query_dtype=torch.float32), "bf16 or fp16 queries only"),
    (dict(head_dim=64), "head dim 128 only"),
    (dict(num_heads=64), "at most 16 query heads per KV head, got 64"),
    (dict(block_size=24), "power-of-two cache block sizes only, got 24"),
])
def test_shape_reason_names_what_it_refuses(kwargs, reason):
    call = dict(query_dtype=torch.bfloat16, cache_dtype=FP8, num_heads=8, num_kv_heads=1, head_dim=128,
                block_size=16, decode=True)
    assert _paged_decode.shape_reason(**call) is None
    call.update(kwargs)
    assert reason in _paged_decode.shape_reason(**call)


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, query_dtype", [
    (8, 1, 16, torch.bfloat16), (32, 8, 1, torch.float16), (16, 1, 64, torch.bfloat16),
    (12, 4, 128, torch.bfloat16),
])
def test_shape_reason_takes_decode_shapes(num_heads, num_kv_heads, block_size, query_dtype):
    assert _paged_decode.shape_reason(query_dtype, FP8, num_heads, num_kv_heads, 128, block_size, True) is None


@pytest.mark.parametrize("ctas, slots, max_seq_len", [
    (64, 528, 4096), (8, 528, 32768), (1, 528, 32768), (512, 528, 4096), (100, 396, 4096), (64, 528, 300),
    (3, 264, 2048),
])
def test_split_count_fills_one_wave_with_long_enough_shares(ctas, slots, max_seq_len):
    splits = _paged_decode.split_count(ctas, slots, max_seq_len)
    assert splits == 1 or max_seq_len // splits >= _paged_decode.MIN_SPLIT_LEN
    if ctas >= slots:
        assert splits == 1
    # No grid of fewer waves' time exists among the allowed counts, and none with fewer splits
    # ties it.
    def time(s):
        return -(-ctas * s // slots) / s
    allowed = [s for s in range(1, 65) if s == 1 or max_seq_len // s >= _paged_decode.MIN_SPLIT_LEN]
    assert time(splits) == min(time(s) for s in allowed)
    assert all(time(s) > time(splits) for s in allowed if s < splits)


def test_split_count_on_the_goal_shapes():
    # 4-warp CTAs on the H100: 132 SMs x 4 CTAs (128 registers a thread). Llama-3-70B TP8 B64 x
    # 4096: 64 CTAs -> 8 splits (512 CTAs, one wave); B8 x 32768: 8 CTAs -> 64 splits; Llama-3-8B
    # B64: 512 CTAs already fill the wave. (By default the first two run 16-warp CTAs:
    # test_wide_split_count.)
    assert _paged_decode.split_count(64, 528, 4096) == 8
    assert _paged_decode.split_count(8, 528, 32768) == 64
    assert _paged_decode.split_count(512, 528, 4096) == 1


def test_override_plan_checks_its_argument():
    with pytest.raises(ValueError, match=r"num_splits must be an int in \[1, 64\] or None, got 0"):
        with _paged_decode.override_plan(num_splits=0):
            pass
    with pytest.raises(ValueError, match="num_splits must be an int in .* got 65"):
        with _paged_decode.override_plan(num_splits=65):
            pass
    with pytest.raises(ValueError, match="warps must be 4, 8, 16 or None, got 2"):
        with _paged_decode.override_plan(warps=2):
            pass
    with pytest.raises(ValueError, match="read_ahead needs more than 128 registers .* got 16"):
        with _paged_decode.override_plan(warps=16, read_ahead=True):
            pass
    with pytest.raises(ValueError, match="overlap must be True, False or None, got 'yes'"):
        with _paged_decode.override_plan(overlap="yes"):
            pass


@pytest.mark.parametrize("plan, capability, warps, splits, ctas, merge_ctas, expected", [
    (_paged_decode.DecodePlan(), (9, 0), 16, 1, 64, 512, (True, True, False)),    # one wave, idle SMs, no merge
    (_paged_decode.DecodePlan(), (9, 0), 16, 16, 8, 64, (True, False, True)),     # a merge of one CTA per SM
    (_paged_decode.DecodePlan(), (9, 0), 16, 8, 16, 132, (True, False, True)),
    (_paged_decode.DecodePlan(), (9, 0), 16, 2, 48, 384, (True, False, False)),   # a merge of several waves
    (_paged_decode.DecodePlan(), (9, 0), 4, 1, 512, 4096, (True, False, False)),  # several waves of 4-warp CTAs
    (_paged_decode.DecodePlan(), (9, 0), 4, 8, 64, 64, (True, False, False)),     # 4-warp CTAs: not measured
    (_paged_decode.DecodePlan(warps=16), (9, 0), 16, 1, 512, 4096, (True, False, False)),  # 16 warps, several waves
    (_paged_decode.DecodePlan(), (8, 9), 16, 1, 64, 512, (False, False, False)),  # no PDL before sm_90
    (_paged_decode.DecodePlan(), (8, 9), 16, 16, 8, 64, (False, False, False)),
    (_paged_decode.DecodePlan(), (10, 0), 16, 1, 64, 512, (True, True, False)),
    (_paged_decode.DecodePlan(overlap=False), (9, 0), 16, 1, 64, 512, (False, False, False)),
    (_paged_decode.DecodePlan(overlap=False), (9, 0), 16, 16, 8, 64, (False, False, False)),
    (_paged_decode.DecodePlan(overlap=True), (9, 0), 4, 4, 64, 512, (True, False, False)),
])
def test_programmatic_launch_choices(plan, capability, warps, splits, ctas, merge_ctas, expected):
    assert _paged_decode._launches(plan, capability, warps, splits, ctas, 132, merge_ctas) == expected


@pytest.mark.parametrize("plan, ctas, max_seq_len, template, warps", [
    # Default: 16 warps where wide_split_count takes the grid and the template holds them.
    (_paged_decode.DecodePlan(), 64, 4096, (1, True, 4, False), 16),
    (_paged_decode.DecodePlan(), 8, 32768, (1, False, 6, False), 16),
    (_paged_decode.DecodePlan(), 131, 4096, (1, True, 4, False), 16),
    (_paged_decode.DecodePlan(), 132, 4096, (1, True, 4, False), 4),  # one CTA per SM or more
    (_paged_decode.DecodePlan(), 512, 4096, (1, True, 4, False), 4),
    (_paged_decode.DecodePlan(), 16, 4096, (1, True, 4, False), 4),  # shares under WIDE_MIN_SHARE
    (_paged_decode.DecodePlan(), 64, 4096, (2, True, 4, False), 4),  # two head tiles
    (_paged_decode.DecodePlan(), 64, 4096, (1, True, 2, False), 4),  # blocks of 4: lookups per position
    (_paged_decode.DecodePlan(), 64, 4096, (1, True, 4, True), 4),  # soft cap
    (_paged_decode.DecodePlan(read_ahead=True), 64, 4096, (1, True, 4, False), 4),
    # A plan's warps are an upper bound.
    (_paged_decode.DecodePlan(warps=8), 64, 4096, (1, True, 4, False), 8),
    (_paged_decode.DecodePlan(warps=16), 512, 4096, (1, True, 4, False), 16),
    (_paged_decode.DecodePlan(warps=16), 64, 4096, (1, True, 4, True), 8),
    (_paged_decode.DecodePlan(warps=16), 64, 4096, (1, True, 0, False), 8),
    (_paged_decode.DecodePlan(warps=16), 64, 4096, (2, True, 4, False), 4),
])
def test_warps_per_cta(plan, ctas, max_seq_len, template, warps):
    assert _paged_decode._warps(plan, ctas, 132, max_seq_len, *template) == warps


@pytest.mark.parametrize("ctas, max_seq_len, splits", [
    # The measured H100 shapes (132 SMs, one KV head): perf/decisions/paged_attention.md.
    (64, 4096, 1),  # B 64 x 4096: unsplit (at least 45% of the SMs)
    (48, 4096, 2),  # B 48: one wave of 96
    (128, 4096, 1),
    (8, 32768, 16),  # B 8 x 32768: one wave of 128, 2048 positions a CTA
    (16, 4096, None),  # one wave would leave 512 positions a CTA: 4-warp CTAs
    (32, 4096, None),
    (16, 16384, 8),
    (64, 2047, None),  # unsplit, but under WIDE_MIN_SHARE
    (132, 4096, None),  # a full grid
    (1, 1 << 20, None),  # one wave would take 132 splits, past the merge kernel's 64
    (0, 4096, None),
])
def test_wide_split_count(ctas, max_seq_len, splits):
    assert _paged_decode.wide_split_count(ctas, 132, max_seq_len) == splits


def _names() -> list[str]:
    """Every decode instantiation the host can ask for (16 warps only where 128 registers hold)."""
    names = [f"paged_decode_fp8<{tiles}, {bf16}, {shift}, {cap}, {split}, {ahead}, {warps}>"
             for tiles, bf16, shift, cap, split, ahead, warps in itertools.product(
                 (1, 2), ("true", "false"), (0, 4), ("false", "true"), ("false", "true"), ("false", "true"),
                 (4, 8, 16))
             if (tiles == 1 or warps == 4) and (warps < 16 or (shift, cap, ahead) == (4, "false", "false"))]
    return names + [f"merge_splits<128, {_paged_decode.MERGE_GROUPS}, {q}>" for q in ("true", "false")]


def _pairs(name: str) -> set[tuple]:
    """The (parameter, value) pairs of a decode instantiation's template arguments, two at a time."""
    arguments = enumerate(re.search(r"<(.*)>", name).group(1).split(", "))
    return set(itertools.combinations(arguments, 2))


def _pairwise_cover(names: list[str]) -> list[str]:
    """A few of ``names`` (greedily) in which every two template arguments appear together with every pair of
    values they take together in ``names``: 8 of the 100 decode instantiations."""
    missing, chosen = set().union(*map(_pairs, names)), []
    while missing:
        best = max(names, key=lambda name: len(_pairs(name) & missing))
        chosen.append(best)
        missing -= _pairs(best)
    return chosen


@needs_nvrtc
@pytest.mark.parametrize("arch", [(8, 9), (10, 0), (12, 0)])
def test_templates_compile_for_the_other_archs(arch):
    # sm_90 compiles every instantiation (below); the other archs a pairwise cover of them and the merges, which
    # reaches every arch-dependent branch with every other argument (the whole set took 105 s of CI for three).
    decode = [name for name in _names() if name.startswith("paged_decode_fp8")]
    names = _pairwise_cover(decode) + [name for name in _names() if name not in decode]
    assert len(names) < len(_names()) / 5
    module = _compile.compile_module(_paged_decode.source(tuple(names)), names, arch, verbose=True)
    assert all(module.registers(name) > 0 for name in names)


@needs_nvrtc
def test_hopper_kernels_hold_their_occupancy_without_spills():
    # Every instantiation the host can ask for, for sm_90: no spills, and the one-tile kernels
    # with whole 16-position tiles per cache block (no soft cap, no read-ahead) fit 128
    # registers: 16 warps per SM, as the goal shapes' warps and split counts assume.
    names = _names()
    module = _compile.compile_module(_paged_decode.source(tuple(names)), names, (9, 0), verbose=True)
    for name in names:
        assert module.spill_bytes(name) == 0, name
    held = [n for n in names if re.fullmatch(r"paged_decode_fp8<1, \w+, 4, false, \w+, false, \d+>", n)]
    assert len(held) == 2 * 2 * 3  # query dtypes x split or not x warps
    for name in held:
        assert module.registers(name) <= 128, (name, module.registers(name))


@needs_nvrtc
def test_traced_build_compiles_without_spills(tmp_path, monkeypatch):
    # perf/diag/cuda_decode_trace.py's build: the marks must not change what they time by spilling.
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    module, decode, _ = _paged_decode._compiled((9, 0), ("KERNELMUX_DIAG_TRACE",), 1, True, 4, False, True, False, 4)
    assert b"kernelmux_trace" in module.cubin
    plain, _, _ = _paged_decode._compiled((9, 0), (), 1, True, 4, False, True, False, 4)
    assert b"kernelmux_trace" not in plain.cubin
    traced = _compile.compile_module(_paged_decode.source((decode,)), [decode], (9, 0), verbose=True,
                                     defines=("KERNELMUX_DIAG_TRACE",))
    assert traced.spill_bytes(decode) == 0


@needs_nvrtc
def test_compile_errors_carry_the_log():
    with pytest.raises(_toolchain.NvrtcError, match="undefined_thing"):
        _compile.compile_module("__global__ void k() { undefined_thing(); }", ["k"], (9, 0))


# ---------------------------------------------------------------------------------------------
# The kernel (GPU)

def _build(make, seed: int) -> dict:
    return build(make, seed, DEVICE)


OPTIONS = {
    "plain": {},
    "scales": {"scales": (0.3, 0.07)},
    "window": {"sliding_window": 70, "scales": (0.5, 2.0)},
    "sinks_cap": {"with_sinks": True, "logits_soft_cap": 2.0, "scale": 0.5},
    "non_causal_fp16": {"causal": False, "dtype": torch.float16},
}
# Lengths 1, under one step, across steps and blocks, none a multiple of 16; a sequence
# without a query.
Q_LENS, KV_LENS = (1, 1, 0, 1, 1, 1), (1, 17, 9, 45, 300, 1029)


@needs_gpu
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 1), (32, 8), (12, 1), (16, 2), (3, 3)])
def test_decode_against_reference(options, block_size, num_heads, num_kv_heads):
    seed = 100 * block_size + 10 * num_heads
    make = pa_spec._maker(Q_LENS, KV_LENS, num_heads, num_kv_heads, 128, block_size=block_size,
                          cache_dtype=FP8, **OPTIONS[options])
    check_paged_attention(_build(make, seed), seed)


@needs_gpu
@pytest.mark.parametrize("options", ["scales", "window", "sinks_cap"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 1), (12, 1), (3, 3)])
@pytest.mark.parametrize("splits", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("plan", [{}, {"read_ahead": True}, {"warps": 4}, {"warps": 8}, {"warps": 16},
                                  {"overlap": False}, {"warps": 16, "overlap": False}],
                         ids=["default", "read_ahead", "warps4", "warps8", "warps16", "plain_launch",
                              "warps16_plain_launch"])
def test_every_plan_against_reference(options, num_heads, num_kv_heads, splits, plan):
    # warps16 with sinks_cap (soft cap) runs 8 warps: the plan's warps are an upper bound.
    seed = 10 * num_heads + splits
    make = pa_spec._maker(Q_LENS, KV_LENS, num_heads, num_kv_heads, 128, block_size=16, cache_dtype=FP8,
                          **OPTIONS[options])
    with _paged_decode.override_plan(num_splits=splits, **plan):
        check_paged_attention(_build(make, seed), seed)


@needs_gpu
def test_decode_ignores_nan_in_unread_slots():
    kwargs = _build(pa_spec._maker((1, 1, 1), (13, 40, 77), 8, 1, 128, block_size=16, cache_dtype=FP8,
                                   spare_blocks=4), 7)
    expected = pa_spec.SPEC.reference(**kwargs)
    read = torch.zeros(kwargs["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    for b, length in enumerate(kwargs["seq_lens"].tolist()):
        for j in range(length):
            read[kwargs["block_table"][b, j // 16], j % 16] = True
    for name in ("k_cache", "v_cache"):
        kwargs[name].view(torch.uint8)[~read] = 0x7F  # e4m3 NaN
    for splits, plan in itertools.product((1, 3), ({}, {"read_ahead": True}, {"warps": 4}, {"warps": 8},
                                                    {"warps": 16})):
        with _paged_decode.override_plan(num_splits=splits, **plan):
            pa_spec.SPEC.check_close(cuda_paged_attention.paged_attention(**kwargs), expected, kwargs)


@needs_gpu
@pytest.mark.parametrize("magnitude", [1e5, 3e30])
def test_bf16_queries_past_fp16_range(magnitude):
    # Scores as with ordinary queries: the softmax scale shrinks by the same factor.
    make = pa_spec._maker((1, 1), (50, 200), 8, 1, 128, cache_dtype=FP8, scale=128**-0.5 / magnitude)
    kwargs = _build(make, 3)
    kwargs["query"] = kwargs["query"] * magnitude
    check_paged_attention(kwargs, 3)


@needs_gpu
def test_misaligned_cache_view_is_refused_by_name():
    kwargs = _build(pa_spec._maker((1,), (40,), 8, 1, 128, cache_dtype=FP8), 1)
    wide = torch.zeros(kwargs["k_cache"].shape[:-1] + (136,), dtype=FP8, device=DEVICE)
    kwargs["k_cache"] = wide[..., 8:]
    reason = ask(cuda_paged_attention.supports, pa_spec.SPEC, kwargs)
    assert reason is not None and reason.startswith("k_cache needs a unit stride along the head dim and 16-byte")
    # Dispatch decides per key, which holds the layout: the call goes elsewhere, and is right.
    expected = pa_spec.SPEC.reference(**kwargs)
    engine = Engine(ALL_SPECS, Settings())
    pa_spec.SPEC.check_close(engine.dispatchers["paged_attention"](**kwargs), expected, kwargs)
    (decision,) = engine.dispatchers["paged_attention"].decisions.values()
    assert decision.backend != "cuda" and dict(decision.answers)["cuda"] == reason


@needs_gpu
@pytest.mark.parametrize("splits, plan", [(None, {}), (1, {}), (4, {}), (None, {"warps": 16}), (4, {"warps": 16}),
                                          (1, {"warps": 16}),  # one wave of 16 warps: dependents launch early
                                          (4, {"overlap": False}), (1, {"warps": 16, "overlap": False})])
def test_decode_graph_replays_new_inputs(splits, plan):
    batch, max_len = 16, 2048
    make = pa_spec._maker((1,) * batch, (max_len,) * batch, 8, 1, 128, cache_dtype=FP8, scales=(0.23, 0.31),
                          spare_blocks=64)
    static = _build(make, 0)
    with _paged_decode.override_plan(num_splits=splits, **plan):
        graph, out = capture(cuda_paged_attention.paged_attention, static)
    replay_on_new_inputs(pa_spec, make, static, graph, out, batch, max_len)


@needs_gpu
@pytest.mark.parametrize("splits, plan", [(1, {"warps": 16}), (4, {"warps": 16}), (None, {}), (3, {"warps": 4})])
def test_decode_overlapping_the_writer_of_its_indices_ignores_stale_values(splits, plan):
    # Launched overlapping the kernel before it, the decode grid warms L2 from its lengths, query
    # offsets and block table while that kernel may still be writing them: what it reads then
    # only chooses what to prefetch, clamped into the table and the cache. Here a kernel writes
    # the index inputs over out-of-range garbage right before each call: the result must be the
    # reference's on the new values, and nothing may fault. (Whether a CTA saw the garbage
    # depends on timing; the rounds make it likely.)
    make = pa_spec._maker((1,) * 8, (1000, 17, 300, 1, 999, 64, 513, 1000), 8, 1, 128, cache_dtype=FP8,
                          scales=(0.23, 0.31), spare_blocks=8)
    kwargs = _build(make, 5)
    expected = pa_spec.SPEC.reference(**kwargs)
    names = ("cu_seqlens_q", "seq_lens", "block_table")
    new = {name: kwargs[name].clone() for name in names}
    with _paged_decode.override_plan(num_splits=splits, **plan):
        for garbage in (1 << 30, -(1 << 30), 0x7FFFFFFF, -1) * 2:
            for name in names:
                kwargs[name].fill_(garbage)
            torch.cuda.synchronize()
            for name in names:
                torch.mul(new[name], 1, out=kwargs[name])  # a kernel (a copy would be a memcpy)
            actual = cuda_paged_attention.paged_attention(**kwargs)
            torch.cuda.synchronize()
            pa_spec.SPEC.check_close(actual, expected, kwargs)

def test_launch_structs_match_cuda_h():
    # cuda.h (12.x, 13.0): CUlaunchAttribute is a 4-byte id, 4 bytes of padding and a 64-byte
    # value union; CUlaunchConfig is six grid/block dims, the shared bytes, then (8-aligned) the
    # stream, the attribute pointer and their count.
    assert ctypes.sizeof(_driver._LaunchAttribute) == 72 and _driver._LaunchAttribute.value.offset == 8
    config = _driver._LaunchConfig
    assert ctypes.sizeof(config) == 56
    assert (config.shared_bytes.offset, config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (
        24, 32, 40, 48)
    attribute = _driver._LaunchAttribute(id=_driver._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.flag = 1
    assert bytes(attribute)[:12] == bytes([6, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0])


@needs_nvrtc
def test_compiled_cubins_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    names = ["merge_splits<128, 2, true>"]
    first = _compile.compile_module_cached(_paged_decode.source(tuple(names)), names, (9, 0))
    assert len(list(tmp_path.glob("cuda/*.cubin"))) == 1
    calls = []
    monkeypatch.setattr(_compile, "compile_module", lambda *a, **k: calls.append(a))
    second = _compile.compile_module_cached(_paged_decode.source(tuple(names)), names, (9, 0))
    assert calls == [] and second.cubin == first.cubin and second.names == first.names
    # Another arch is another entry.
    monkeypatch.undo()
    monkeypatch.setenv("KERNELMUX_CACHE_DIR", str(tmp_path))
    _compile.compile_module_cached(_paged_decode.source(tuple(names)), names, (8, 9))
    assert len(list(tmp_path.glob("cuda/*.cubin"))) == 2


class _Mirror(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("n", ctypes.c_int32), ("stride", ctypes.c_int64),
                ("scale", ctypes.c_float)]


def test_launch_parameters_hold_each_field_by_kind():
    # What cuLaunchKernel reads: ``kernelParams``, a pointer to each field of the params struct in
    # order; each field holds its argument's value in its C type.
    kernel = _driver.Kernel(ctypes.c_void_p(0), _Mirror, 128, None)
    tensor = torch.arange(4.0)

    def read(pointers):
        assert len(pointers) == len(_Mirror._fields_)
        return [ctypes.cast(pointer, ctypes.POINTER(kind)).contents.value
                for pointer, (_, kind) in zip(pointers, _Mirror._fields_)]

    pointers = kernel.parameters(x=tensor, y=None, n=-7, stride=1 << 40, scale=0.25)
    assert read(pointers) == [tensor.data_ptr(), None, -7, 1 << 40, 0.25]
    # Refilled per call; another thread gets its own storage, so concurrent launches do not mix.
    other = torch.arange(8.0)
    pointers = kernel.parameters(x=other, y=other, n=3, stride=-1, scale=2.0)
    assert read(pointers) == [other.data_ptr(), other.data_ptr(), 3, -1, 2.0]
    seen = {}
    thread = threading.Thread(
        target=lambda: seen.update(pointers=kernel.parameters(x=tensor, y=None, n=1, stride=2, scale=3.0)))
    thread.start()
    thread.join()
    assert seen["pointers"][0] != kernel.parameters(x=other, y=other, n=3, stride=-1, scale=2.0)[0]
    # Every field named, none unknown: a field left out would keep the previous call's value.
    with pytest.raises(TypeError, match=r"_Mirror: missing fields \['n', 'scale', 'stride'\], unknown fields \[\]"):
        kernel.parameters(x=tensor, y=None)
    with pytest.raises(TypeError, match=r"unknown fields \['z'\]"):
        kernel.parameters(x=tensor, y=None, n=1, stride=2, scale=3.0, z=4)


def test_loaded_kernels_build_once_per_device_and_key(monkeypatch):
    # Both backends keep their kernels in a LoadedKernels: one build and one module load per
    # (device, key), also when threads race for the first call; kernels of a module in spec order.
    loads = []

    def fake_load(module, name, params, block, loaded=None, shared_bytes=0):
        loads.append((name, loaded, shared_bytes))
        return (name, block, shared_bytes), f"module of {name}" if loaded is None else loaded

    monkeypatch.setattr(_driver, "load_kernel", fake_load)
    builds = []
    specs = [_driver.KernelSpec("decode<true>", _Mirror, 256, 4096), _driver.KernelSpec("merge<true>", _Mirror, 128)]

    def build():
        builds.append(1)
        return "module", specs

    cache = _driver.LoadedKernels()
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("cuda:0", ("key",), build)))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and len(set(results)) == 1
    assert results[0] == (("decode<true>", 256, 4096), ("merge<true>", 128, 0))
    # The second kernel loads from the first one's module.
    assert loads == [("decode<true>", None, 4096), ("merge<true>", "module of decode<true>", 0)]
    cache.get("cuda:1", ("key",), build)
    cache.get("cuda:0", ("other",), build)
    assert len(builds) == 3 and len(cache.loaded()) == 3
    cache.clear()
    assert cache.loaded() == []


@pytest.mark.parametrize("platform, nvrtc, op, reason", [
    ("gfx942", True, "paged_attention", "needs a cuda platform, this is rocm"),
    ("sm_86", True, "paged_attention", "needs capability >= 8.9, this has 8.6"),
    ("sm_90", False, "paged_attention", "NVRTC not found (pip install nvidia-cuda-nvrtc, which torch's CUDA "
                                        "wheels bring, or a CUDA toolkit)"),
    ("sm_90", True, "paged_attention", None),
    ("sm_100", True, "paged_attention", None),  # the fp8 decode kernel; prefill declines per call
    ("sm_100", True, "mla_decode", "needs arch in {sm_90}, this is sm_100"),  # sm_90a cubins
    ("sm_120", True, "mla_decode", "needs arch in {sm_90}, this is sm_120"),
    ("sm_90", True, "mla_decode", None),
])
def test_platform_problem_names_what_the_platform_lacks(monkeypatch, platform, nvrtc, op, reason):
    # The requirement and the NVRTC check are static: asked once per platform (at startup, or
    # for a device whose platform differs), never per call; simulated platforms answer as the
    # real ones would.
    monkeypatch.setattr(_toolchain, "find_nvrtc", lambda: object() if nvrtc else None)
    registry = Registry({spec.name: spec for spec in ALL_SPECS})
    registry.load_entry_points(["cuda"])
    impl = registry.implementations[(op, "cuda")]
    assert impl.platform_problem(simulate(platform)) == reason


