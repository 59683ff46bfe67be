"""The triton backend's paged_attention beyond the named cases: every plan shape, the compact plans,
cache block sizes, drawn varlen batches with every option, NaN in unread slots, what supports
refuses, and CUDA-graph replays with changed inputs (GPU only)."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from fakes import ask
from graph_replay import build, capture, replay_on_new_inputs
from kernelmux.backends.triton import _attention
from kernelmux.backends.triton.paged_attention import paged_attention, supports
from kernelmux.platforms import simulate
from kernelmux.registry import signature_difference
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.specs.kv_cache_write import FP8

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def _build(make, seed: int) -> dict:
    return build(make, seed, DEVICE)


def _check_paged(kwargs, seed):
    """paged_attention against the spec's reference, the seed named on a mismatch."""
    expected = pa_spec.SPEC.reference(**kwargs)
    actual = paged_attention(**kwargs)
    try:
        pa_spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def test_signatures_match_the_spec():
    assert signature_difference(pa_spec.SPEC.signature, paged_attention) is None
    assert list(inspect.signature(supports).parameters) == ["key", "platform"]


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
    with _attention.override_plan(block_m=block_m, block_n=block_n, num_splits=num_splits,
                                 prefetch_pages=prefetch_pages):
        _check_paged(kwargs, seed)


@pytest.mark.parametrize("kind", sorted(k for k in _attention._COMPACT_TABLE if not k.startswith("mla")))
def test_compact_table_plans(kind):
    # The plans for GPUs with 99 KB of shared memory, on the mixed batch (decode: one query each).
    plan = dataclasses.asdict(_attention._COMPACT_TABLE[kind])
    options = OPTIONS["fp8"] if kind == "decode_fp8" else {}
    shape = dict(MIXED, q_lens=(1,) * 4) if kind.startswith("decode") else MIXED
    kwargs = _build(pa_spec._maker(**shape, **options), 7)
    with _attention.override_plan(**plan):
        _check_paged(kwargs, 7)


@pytest.mark.parametrize("capability, refused", [
    ((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False),
])
def test_fp8_caches_need_sm89(capability, refused):
    platform = simulate(f"sm_{capability[0]}{capability[1]}")
    fp8 = pa_spec.SPEC.case("small_fp8").build()
    reason = ask(supports, pa_spec.SPEC, fp8, platform)
    assert (reason is not None) == refused
    if refused:
        assert f"this GPU is sm_{capability[0]}{capability[1]}" in reason
    bf16 = pa_spec.SPEC.case("small_mixed_batch").build()
    assert ask(supports, pa_spec.SPEC, bf16, platform) is None


@pytest.mark.parametrize("block_size", [1, 2, 16, 32, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_block_sizes(block_size, num_splits):
    # Lengths 1, one short of a block, one past it and several blocks plus a partial one.
    lens = (1, max(block_size - 1, 1), block_size + 1, 3 * block_size + 5)
    kwargs = _build(pa_spec._maker((1,) * 4, lens, 8, 2, 64, block_size=block_size), block_size)
    with _attention.override_plan(num_splits=num_splits):
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
    with _attention.override_plan(**plan):
        _check_paged(kwargs, seed)


def test_fp8_cache_queries_past_fp16_range():
    # fp8 caches run the dots in fp16 (max 65504): bf16 queries up to 3e5 must still match the
    # reference, so the kernel scales such a tile by a power of two. The softmax scale shrinks by
    # the same factor so the scores stay in the usual range.
    kwargs = _build(pa_spec._maker((1, 4), (9, 30), 8, 2, 32, block_size=8, cache_dtype=FP8,
                                   scales=(0.3, 0.07), scale=1e-5), 11)
    kwargs["query"] = (kwargs["query"].float() * 1e5).to(kwargs["query"].dtype)
    assert kwargs["query"].abs().max() > 65504
    for splits in (1, 2):
        with _attention.override_plan(num_splits=splits):
            _check_paged(kwargs, 11)


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
    actual = paged_attention(**kwargs)
    pa_spec.check_close(actual, expected, kwargs)


def test_supports_names_what_it_refuses():
    kwargs = pa_spec.SPEC.case("single_token").build(DEVICE)
    spec = pa_spec.SPEC
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
    with _attention.override_plan(**plan):
        graph, out = capture(paged_attention, static)
        replay_on_new_inputs(pa_spec, make, static, graph, out, batch, max_len)
