"""The triton backend's paged_attention and mla_decode kernels beyond the named cases: every
launch-plan shape (rows per tile, KV step, forced KV splits), cache block sizes, drawn varlen
batches with every option, NaN in unread cache slots, plans from host ints only, and CUDA-graph
replays with changed inputs (GPU only)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from fakes import ask
from graph_replay import build, capture, replay_on_new_inputs
from kernelmux.backends.triton import attention
from kernelmux.platforms import simulate
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.specs.kv_cache_write import FP8

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def _build(make, seed: int) -> dict:
    return build(make, seed, DEVICE)


def _check(spec_module, fn, kwargs, seed):
    """fn against the spec's reference, the seed named on a mismatch."""
    expected = spec_module.SPEC.reference(**kwargs)
    actual = fn(**kwargs)
    try:
        spec_module.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def _check_paged(kwargs, seed):
    _check(pa_spec, attention.paged_attention, kwargs, seed)


def _check_mla(kwargs, seed):
    _check(mla_spec, attention.mla_decode, kwargs, seed)


# A chunked prefill, a decode, a full prefill and a sequence without queries, with every option.
MIXED = dict(q_lens=(5, 1, 9, 0), kv_lens=(23, 17, 9, 6), num_heads=8, num_kv_heads=2, head_dim=32,
             block_size=8)
OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 6},
    "sinks_cap": {"with_sinks": True, "logits_soft_cap": 2.0, "scale": 0.5},
    "fp8": {"cache_dtype": FP8, "scales": (0.3, 0.07)},
    "non_causal": {"causal": False},
}


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 32), (64, 16), (16, 64)])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("prefetch_pages", [False, True], ids=["table_in_step", "table_prefetched"])
def test_paged_attention_every_plan_shape(options, block_m, block_n, num_splits, prefetch_pages):
    seed = 1000 * block_m + block_n + num_splits
    kwargs = _build(pa_spec._maker(**MIXED, **OPTIONS[options]), seed)
    with attention.override_plan(block_m=block_m, block_n=block_n, num_splits=num_splits,
                                 prefetch_pages=prefetch_pages):
        _check_paged(kwargs, seed)


@pytest.mark.parametrize("kind", sorted(attention._COMPACT_TABLE))
def test_compact_table_plans(kind):
    # The plans for GPUs with 99 KB of shared memory, on the mixed batch (MLA: an MTP batch).
    plan = dataclasses.asdict(attention._COMPACT_TABLE[kind])
    if kind.startswith("mla"):
        case = "small_fp8" if kind == "mla_fp8" else "small_mtp_fp16"
        kwargs = mla_spec.SPEC.case(case).build(DEVICE, 7)
        with attention.override_plan(**plan):
            _check_mla(kwargs, 7)
    else:
        options = OPTIONS["fp8"] if kind == "decode_fp8" else {}
        shape = dict(MIXED, q_lens=(1,) * 4) if kind.startswith("decode") else MIXED
        kwargs = _build(pa_spec._maker(**shape, **options), 7)
        with attention.override_plan(**plan):
            _check_paged(kwargs, 7)


@pytest.mark.parametrize("capability, table", [
    ((9, 0), "_TABLE"), ((10, 0), "_TABLE"), ((8, 0), "_COMPACT_TABLE"), ((8, 9), "_COMPACT_TABLE"),
    ((12, 0), "_COMPACT_TABLE"),
])
def test_plan_table_follows_shared_memory(monkeypatch, capability, table):
    monkeypatch.setattr(attention, "_capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    for kind, plan in getattr(attention, table).items():
        assert attention._base_plan(kind, torch.device("cuda")) == plan
    assert attention._base_plan("prefill", torch.device("cpu")) == attention._TABLE["prefill"]
    # ROCm: gfx942 reports (9, 4) but has 64 KB of LDS; Intel GPUs: 64-128 KB.
    assert attention._base_plan("mla", torch.device("xpu")) == attention._COMPACT_TABLE["mla"]
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert attention._base_plan("mla", torch.device("cuda")) == attention._COMPACT_TABLE["mla"]


@pytest.mark.parametrize("capability, refused", [
    ((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False),
])
def test_fp8_caches_need_sm89(capability, refused):
    platform = simulate(f"sm_{capability[0]}{capability[1]}")
    fp8 = pa_spec.SPEC.case("small_fp8").build()
    reason = ask(attention.paged_attention_supports, pa_spec.SPEC, fp8, platform)
    assert (reason is not None) == refused
    if refused:
        assert f"this GPU is sm_{capability[0]}{capability[1]}" in reason
    bf16 = pa_spec.SPEC.case("small_mixed_batch").build()
    assert ask(attention.paged_attention_supports, pa_spec.SPEC, bf16, platform) is None


@pytest.mark.parametrize("block_size", [1, 2, 16, 32, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_block_sizes(block_size, num_splits):
    # Lengths 1, one short of a block, one past it and several blocks plus a partial one.
    lens = (1, max(block_size - 1, 1), block_size + 1, 3 * block_size + 5)
    kwargs = _build(pa_spec._maker((1,) * 4, lens, 8, 2, 64, block_size=block_size), block_size)
    with attention.override_plan(num_splits=num_splits):
        _check_paged(kwargs, block_size)


@st.composite
def paged_batches(draw):
    batch = draw(st.integers(1, 4))
    kv_lens = tuple(draw(st.integers(1, 40)) for _ in range(batch))
    decode = draw(st.booleans())
    causal = decode or draw(st.booleans())
    q_lens = tuple(1 if decode else draw(st.integers(0, kv)) for kv in kv_lens)
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        q_lens=q_lens, kv_lens=kv_lens,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 3, 4, 8])), num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([16, 24, 64])),
        block_size=draw(st.sampled_from([1, 4, 16])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        causal=causal,
        sliding_window=draw(st.sampled_from([0, 1, 5])) if causal else 0,
        logits_soft_cap=draw(st.sampled_from([0.0, 5.0])),
        with_sinks=draw(st.booleans()),
        shared_prefix_blocks=draw(st.sampled_from([0, 1])),
    )


@settings(max_examples=25 if INTERPRETED else 200)
@given(shape=paged_batches(), fp8=st.booleans(), splits=st.sampled_from([None, 1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_paged_attention_random_batches(shape, fp8, splits, seed):
    if fp8:
        shape.update(cache_dtype=FP8, scales=(0.25, 0.5))
    kwargs = _build(pa_spec._maker(**shape), seed)
    plan = {} if splits is None else {"num_splits": splits}
    with attention.override_plan(**plan):
        _check_paged(kwargs, seed)


@pytest.mark.parametrize("op", ["paged_attention", "mla_decode"])
def test_fp8_cache_queries_past_fp16_range(op):
    # fp8 caches run the dots in fp16 (max 65504): bf16 queries up to 3e5 must still match the
    # reference, so the kernel scales such a tile by a power of two. The softmax scale shrinks by
    # the same factor so the scores stay in the usual range.
    if op == "paged_attention":
        kwargs = _build(pa_spec._maker((1, 4), (9, 30), 8, 2, 32, block_size=8, cache_dtype=FP8,
                                       scales=(0.3, 0.07), scale=1e-5), 11)
        name, check = "query", _check_paged
    else:
        kwargs = mla_spec.SPEC.case("small_fp8").build(DEVICE, 11)
        kwargs["scale"] = kwargs["scale"] * 1e-5
        name, check = "q", _check_mla
    kwargs[name] = (kwargs[name].float() * 1e5).to(kwargs[name].dtype)
    assert kwargs[name].abs().max() > 65504
    for splits in (1, 2):
        with attention.override_plan(num_splits=splits):
            check(kwargs, 11)


def test_paged_attention_ignores_nan_in_unread_slots():
    kwargs = _build(pa_spec._maker((1, 3), (13, 21), 4, 2, 16, block_size=8, spare_blocks=4), 7)
    expected = pa_spec.paged_attention(**kwargs)
    # Poison every slot no sequence reads: block tails past each length and the spare blocks.
    read = torch.zeros(kwargs["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    for b, length in enumerate(kwargs["seq_lens"].tolist()):
        for j in range(length):
            read[kwargs["block_table"][b, j // 8], j % 8] = True
    for name in ("k_cache", "v_cache"):
        kwargs[name][~read] = float("nan")
    actual = attention.paged_attention(**kwargs)
    pa_spec.check_close(actual, expected, kwargs)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (64, 32), (32, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", ["small_mtp_fp16", "small_fp8", "partial_blocks", "nan_in_unused_slots"])
def test_mla_decode_every_plan_shape(case, block_m, block_n, num_splits):
    seed = 1000 * block_m + block_n + num_splits
    kwargs = mla_spec.SPEC.case(case).build(DEVICE, seed)
    with attention.override_plan(block_m=block_m, block_n=block_n, num_splits=num_splits):
        _check_mla(kwargs, seed)


def test_plan_uses_host_ints_only_and_splits_small_grids():
    device = torch.device(DEVICE)
    sms = attention._sm_count(device)
    # Many sequences: the grid already fills the device, no split.
    many = attention.plan_for("decode", device, 64 * sms, 64 * sms, 4, 8, 1, 4096, head_dim=128)
    assert many.num_splits == 1
    # One long sequence, one KV head: split up to the per-SM target, bounded by the length.
    one = attention.plan_for("decode", device, 1, 1, 8, 1, 1, 32768, head_dim=128)
    assert 1 < one.num_splits <= attention._MAX_SPLITS
    short = attention.plan_for("decode", device, 1, 1, 8, 1, 1, attention._MIN_SPLIT_LEN, head_dim=128)
    assert short.num_splits == 1
    with attention.override_plan(num_splits=3, block_n=16):
        forced = attention.plan_for("decode", device, 1, 1, 8, 1, 1, 100, head_dim=128)
    assert (forced.num_splits, forced.block_n) == (3, 16)
    with pytest.raises(ValueError, match="unknown AttentionPlan fields"):
        with attention.override_plan(block_k=3):
            pass


@pytest.mark.parametrize("kind, seqs, group, kv_heads, seq_len, splits", [
    ("decode", 64, 4, 8, 4096, 1),  # Llama-3-8B B64: 512 programs already fill 132 SMs
    ("decode", 64, 8, 1, 4096, 4),  # Llama-3-70B TP8 B64: 256 of 264 slots, one wave (8: two, no faster)
    ("decode_fp8", 8, 8, 1, 32768, 32),  # B8 x 32768: 8 programs x 32 splits, one wave
    ("decode", 8, 8, 1, 1024, 2),  # bounded by the length: 1024 / 512
    ("mla", 64, 128, 1, 4096, 1),  # 128 programs of 64 heads fill 128 of 132 SMs; 2 splits: 2 waves
    ("mla", 128, 128, 1, 4096, 1),
    ("mla", 8, 128, 1, 4096, 8),  # 16 programs: 8 splits fill one wave (16 would take two)
    ("decode", 40, 8, 1, 4096, 4),  # 40 programs: 4 splits (160 of 264 slots) as fast as 8 (two waves)
    ("mla", 100, 128, 1, 4096, 1),  # 200 programs in 2 waves are no faster than 100 in one
])
def test_split_counts_on_an_h100_grid(monkeypatch, kind, seqs, group, kv_heads, seq_len, splits):
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    plan = attention.plan_for(kind, torch.device("cpu"), seqs, seqs, group, kv_heads, 1, seq_len,
                              head_dim=128)
    assert plan.num_splits == splits


@pytest.mark.parametrize("tokens, head_dim, large", [
    (8192, 128, True),  # 257 tiles x 8 KV heads = 15.6 waves of one program per SM
    (1024, 128, False),  # 2 waves
    (8192, 256, False),  # the large tile does not fit shared memory at head dim 256
])
def test_large_prefill_plan_for_long_prefills(monkeypatch, tokens, head_dim, large):
    monkeypatch.setattr(attention, "_sm_count", lambda device: 132)
    plan = attention.plan_for("prefill", torch.device("cpu"), 1, tokens, 4, 8, tokens, tokens,
                              head_dim=head_dim)
    kind = "prefill_large" if large else "prefill"
    assert plan == attention._TABLE[kind]  # a grid of a wave or more never splits


def test_plans_that_do_not_fit_step_down(monkeypatch):
    # A GPU that cannot hold KV steps past 32 positions (Triton raises OutOfResources when the
    # kernel is loaded): the call still matches the reference, on the first smaller plan that
    # runs, and later calls go to that plan directly.
    from triton.runtime.errors import OutOfResources

    real_launch = attention._launch
    tried = []

    def small_gpu_launch(*, plan, **args):
        tried.append(plan)
        if plan.block_n > 32:
            raise OutOfResources(300_000, 232_448, "shared memory")
        real_launch(plan=plan, **args)

    monkeypatch.setattr(attention, "_launch", small_gpu_launch)
    monkeypatch.setattr(attention, "_FITTED", {})
    kwargs = _build(pa_spec._maker(**MIXED), 11)
    with attention.override_plan(block_n=128, num_splits=1):
        _check_paged(kwargs, 11)
        assert [p.block_n for p in tried] == [128, 64, 32]
        tried.clear()
        _check_paged(kwargs, 11)
        assert [p.block_n for p in tried] == [32]
    smallest = attention.AttentionPlan(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert attention._smaller(smallest) is None


def test_supports_names_what_it_refuses():
    kwargs = pa_spec.SPEC.case("single_token").build(DEVICE)
    supports, spec = attention.paged_attention_supports, pa_spec.SPEC
    assert ask(supports, spec, kwargs) is None
    wide = dict(kwargs, query=torch.zeros(1, 4, 512, dtype=torch.bfloat16, device=DEVICE),
                k_cache=torch.zeros(*kwargs["k_cache"].shape[:3], 512, dtype=torch.bfloat16, device=DEVICE))
    wide["v_cache"] = wide["k_cache"]
    assert "head dim 512" in ask(supports, spec, wide)
    strided = dict(kwargs, query=kwargs["query"].repeat(1, 1, 2)[..., ::2])
    assert "non-unit stride" in ask(supports, spec, strided)
    # The index tensors may have any strides: the kernel reads them (test_index_strides).
    columns = dict(kwargs, block_table=kwargs["block_table"].t().contiguous().t())
    assert ask(supports, spec, columns) is None


@pytest.mark.parametrize("num_seqs, refused", [(65535, False), (65536, True)])
def test_supports_refuses_grids_past_cudas_axis_limit(num_seqs, refused):
    # supports reads the key only: meta tensors stand in for a 65536-sequence MLA decode batch
    # on an H100 (one query per sequence: one tile each).
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")
    kwargs = dict(q=meta(num_seqs, 16, 576), kv_cache=meta(8, 64, 576),
                  cu_seqlens_q=meta(num_seqs + 1, dtype=torch.int32), block_table=meta(num_seqs, 1, dtype=torch.int32),
                  seq_lens=meta(num_seqs, dtype=torch.int32), max_query_len=1, max_seq_len=64, scale=0.1)
    reason = ask(attention.mla_decode_supports, mla_spec.SPEC, kwargs, simulate("sm_90"))
    assert (reason is not None) == refused
    if refused:
        assert "up to 131071 query tiles (this batch's size class) > 65535" in reason


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the plan depends on host ints only, so a captured decode replays correctly on
# new lengths, block tables and queries (within the max_seq_len of the capture).

needs_cuda = pytest.mark.skipif(DEVICE != "cuda",
                                reason="CUDA graphs need a CUDA device; runs in the GPU suite")


@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_attention_decode_graph_replays_new_inputs(num_splits, fp8):
    options = {"cache_dtype": FP8, "scales": (0.23, 0.31)} if fp8 else {}
    batch, max_len = 16, 2048
    make = pa_spec._maker((1,) * batch, (max_len,) * batch, 32, 8, 128, spare_blocks=64, **options)
    static = _build(make, 0)
    plan = {} if num_splits is None else {"num_splits": num_splits}
    with attention.override_plan(**plan):
        graph, out = capture(attention.paged_attention, static)
        replay_on_new_inputs(pa_spec, make, static, graph, out, batch, max_len)


@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_decode_graph_replays_new_inputs(num_splits):
    batch, max_len = 8, 1024
    make = mla_spec._maker((1,) * batch, (max_len,) * batch, 128, scale=mla_spec.DEEPSEEK_V3_SCALE,
                           spare_blocks=16)
    static = _build(make, 0)
    plan = {} if num_splits is None else {"num_splits": num_splits}
    with attention.override_plan(**plan):
        graph, (out, lse) = capture(attention.mla_decode, static)
        replay_on_new_inputs(mla_spec, make, static, graph, (out, lse), batch, max_len)
