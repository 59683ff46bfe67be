"""The flashinfer backend's paged_attention against a fake flashinfer that holds the shipped signatures,
checks and layouts (tests/vendors/flashinfer: decode.py, prefill.py): the adapter's results against the
spec's reference, decode batches on xqa (asked for by name, also on sm_100) and the rest on the prefill
wrapper, its declines (fp8 caches, k/v caches of different strides among them), keyword calls, capture
refusal, and the vendor mechanism's quarantine and first-call log. On a GPU with
flashinfer installed, tests/backends/test_conformance.py runs the real one against the reference."""

from __future__ import annotations

import importlib
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER, _paged
from kernelmux.backends.flashinfer import paged_attention as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import paged_attention as spec
from vendors import install_fake, reversed_signature, sources

FP8 = torch.float8_e4m3fn
SM90 = simulate("sm_90")
DECODE = ["trtllm_batch_decode_with_kv_cache", "xqa_batch_decode_with_kv_cache"]
PREFILL = ["BatchPrefillWithPagedKVCacheWrapper.plan", "BatchPrefillWithPagedKVCacheWrapper.run"]


def _install(monkeypatch, tmp_path, version="0.6.14", files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", version, files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    monkeypatch.setattr(_paged, "_wrappers", {})  # a wrapper of an earlier test's fake must not serve
    return SimpleNamespace(decode=importlib.import_module("flashinfer.decode"),
                           prefill=importlib.import_module("flashinfer.prefill"))


def _entries(module, prefix=""):
    return [call["entry"] for call in module.CALLS if call["entry"].startswith(prefix)]


def _batch(q_lens, kv_lens, num_heads, num_kv_heads, head_dim, seed=0, **options):
    return spec._maker(tuple(q_lens), tuple(kv_lens), num_heads, num_kv_heads, head_dim, **options)(
        torch.device("cpu"), torch.Generator().manual_seed(seed))


def _check(vendor, kwargs, path, platform=SM90):
    """The adapter's output against the reference, and the vendor entry it took ("decode",
    "prefill" or None when nothing reached FlashInfer); a decode batch must reach xqa."""
    assert ask(adapter.supports, spec.SPEC, kwargs, platform) is None
    vendor.decode.CALLS.clear()
    vendor.prefill.CALLS.clear()
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    assert _entries(vendor.decode) == (DECODE if path == "decode" else [])
    if path == "decode":
        assert vendor.decode.CALLS[0]["backend"] == "xqa"
    assert _entries(vendor.prefill, "BatchPrefillWithPagedKVCacheWrapper.") == (PREFILL if path == "prefill" else [])


# The spec's small cases FlashInfer takes on sm_90 (the rest it declines; see the next test) and one
# model case of each path that stays fast on a 2-core CPU.
SPEC_CASES = {
    "small_gqa_decode_fp16": "decode",
    "single_token": "decode",
    "gpt_oss_120b_tp8_window_sinks_decode": "decode",
    "gemma2_soft_cap": "prefill",
    "empty_batch": None,
    "no_queries": None,
}
SPEC_DECLINED = {  # the spec's random and edge cases FlashInfer declines on sm_90, and why
    "small_mixed_batch": "head dims [64, 128, 256] only for prefill batches, got 32",
    "small_non_causal": "head dims [64, 128, 256] only for prefill batches, got 16",
    "small_sliding_window": "head dims [64, 128, 256] only for prefill batches, got 32",
    "small_soft_cap_sinks_window": "head dims [64, 128, 256] only for prefill batches, got 16",
    "small_fp8": "a cache of the query's dtype only for prefill batches, got torch.float8_e4m3fn",
    "small_fp8_no_scale": "a cache of the query's dtype only for prefill batches",
    "partial_blocks": "head dims [64, 128, 256] only for prefill batches, got 16",
    "table_slack_shared_prefix": "head dims [64, 128, 256] only for prefill batches, got 16",
    "block_size_1": "head dims [64, 128, 256] only for prefill batches, got 8",
    "window_edges": "head dims [64, 128, 256] only for prefill batches, got 8",
    "window_wider_than_context": "head dims [64, 128, 256] only for prefill batches, got 8",
}
CASES = {case.name: case for case in spec.SPEC.cases}


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_the_spec_cases_match_the_reference(vendor, name):
    _check(vendor, CASES[name].build(seed=1), SPEC_CASES[name])


def test_every_small_spec_case_is_taken_or_declined_by_name():
    small = {case.name for case in spec.SPEC.cases if case.tags & {"random", "edge"}}
    assert small <= set(SPEC_CASES) | set(SPEC_DECLINED), "a new small case: add it above"
    for name, reason in SPEC_DECLINED.items():
        assert reason in ask(adapter.supports, spec.SPEC, CASES[name].build(), SM90), name


# Batches beyond the spec's cases in the shapes FlashInfer takes (head dims 64/128/256, page sizes
# of xqa): every option of each path.
DECODE_BATCHES = {
    "fp16_scale": dict(q_lens=(1, 1), kv_lens=(5, 33), num_heads=4, num_kv_heads=1, head_dim=64,
                       dtype=torch.float16, scale=0.05),
    "window_across_pages": dict(q_lens=(1,) * 4, kv_lens=(5, 40, 64, 100), num_heads=4, num_kv_heads=1,
                                head_dim=64, sliding_window=32),
    "sinks": dict(q_lens=(1,) * 3, kv_lens=(3, 50, 200), num_heads=8, num_kv_heads=2, head_dim=128,
                  block_size=32, with_sinks=True),
    "window_sinks_page_64": dict(q_lens=(1,) * 3, kv_lens=(70, 129, 2), num_heads=8, num_kv_heads=4,
                                 head_dim=64, block_size=64, sliding_window=65, with_sinks=True),
    "group_32_page_128": dict(q_lens=(1, 1), kv_lens=(130, 7), num_heads=32, num_kv_heads=1, head_dim=16,
                              block_size=128, table_slack=3),
    "non_causal": dict(q_lens=(1, 1), kv_lens=(20, 9), num_heads=4, num_kv_heads=2, head_dim=64, causal=False),
    "shared_prefix_slack": dict(q_lens=(1, 1, 1), kv_lens=(40, 36, 48), num_heads=4, num_kv_heads=2,
                                head_dim=64, table_slack=9, spare_blocks=20, shared_prefix_blocks=2),
    "non_causal_empty_sequence": dict(q_lens=(1, 1), kv_lens=(0, 9), num_heads=4, num_kv_heads=2, head_dim=64,
                                      causal=False, with_sinks=True),
}
# fp8 caches: xqa takes them (mha_sm90.cu), but rounds Q and the probabilities to e4m3, outside the
# spec's tolerance at short contexts and for fp16 queries; the adapter declines them.
FP8_DECODE_BATCHES = {
    "fp8_k_scale_ne_v_scale": dict(q_lens=(1, 1, 1), kv_lens=(40, 17, 100), num_heads=8, num_kv_heads=2,
                                   head_dim=64, cache_dtype=FP8, scales=(0.3, 0.07)),
    "fp8_fp16_no_scales": dict(q_lens=(1, 1), kv_lens=(5, 33), num_heads=4, num_kv_heads=1, head_dim=64,
                               dtype=torch.float16, cache_dtype=FP8, scale=0.05),
    "fp8_window_sinks_page_64": dict(q_lens=(1,) * 3, kv_lens=(70, 129, 2), num_heads=8, num_kv_heads=4,
                                     head_dim=64, block_size=64, sliding_window=65, with_sinks=True,
                                     cache_dtype=FP8, scales=(0.2, 0.45)),
}
PREFILL_BATCHES = {
    "mixed_with_a_sequence_without_queries": dict(q_lens=(3, 1, 9, 0, 5), kv_lens=(10, 8, 9, 6, 21), num_heads=6,
                                                  num_kv_heads=2, head_dim=64, block_size=8),
    "empty_sequence": dict(q_lens=(3, 0, 2), kv_lens=(5, 0, 9), num_heads=4, num_kv_heads=2, head_dim=64),
    "non_causal": dict(q_lens=(4, 7), kv_lens=(9, 7), num_heads=4, num_kv_heads=4, head_dim=64, block_size=4,
                       causal=False),
    "sliding_window": dict(q_lens=(6, 1, 12), kv_lens=(20, 13, 12), num_heads=4, num_kv_heads=1, head_dim=128,
                           block_size=4, sliding_window=5),
    "window_of_one": dict(q_lens=(3, 1), kv_lens=(3, 9), num_heads=2, num_kv_heads=1, head_dim=64, block_size=4,
                          sliding_window=1),
    "soft_cap_window_fp16": dict(q_lens=(2, 5), kv_lens=(11, 5), num_heads=4, num_kv_heads=2, head_dim=256,
                                 dtype=torch.float16, block_size=4, logits_soft_cap=3.0, scale=0.6,
                                 sliding_window=4),
    "shared_prefix_slack": dict(q_lens=(1, 4, 1), kv_lens=(40, 36, 48), num_heads=4, num_kv_heads=2, head_dim=64,
                                block_size=8, table_slack=9, spare_blocks=20, shared_prefix_blocks=3),
    "block_size_1": dict(q_lens=(2, 1), kv_lens=(5, 3), num_heads=2, num_kv_heads=1, head_dim=64, block_size=1),
    "non_causal_empty_sequence": dict(q_lens=(2, 3), kv_lens=(0, 9), num_heads=4, num_kv_heads=2, head_dim=64,
                                      causal=False),
}


@pytest.mark.parametrize("name", sorted(DECODE_BATCHES))
def test_decode_batches_take_the_decode_entry(vendor, name):
    _check(vendor, _batch(seed=2, **DECODE_BATCHES[name]), "decode")


@pytest.mark.parametrize("name", sorted(PREFILL_BATCHES))
def test_prefill_and_mixed_batches_take_the_wrapper(vendor, name):
    _check(vendor, _batch(seed=3, **PREFILL_BATCHES[name]), "prefill")


@pytest.mark.parametrize("name", sorted(FP8_DECODE_BATCHES))
def test_fp8_decode_batches_are_declined(name):
    kwargs = _batch(seed=2, **FP8_DECODE_BATCHES[name])
    assert ask(adapter.supports, spec.SPEC, kwargs, SM90) == \
        "a cache of the query's dtype only (xqa's fp8 path computes in e4m3), got torch.float8_e4m3fn"


@pytest.mark.parametrize("platform", ["sm_90", "sm_100", "sm_120"])
def test_decode_asks_for_xqa_by_name(vendor, monkeypatch, platform):
    # FlashInfer's backend="auto" is trtllm-gen on sm_100 (a kernel the adapter is not written for):
    # the fake picks as the shipped one does, by the device's major, so "auto" would miss xqa there.
    monkeypatch.setattr(vendor.decode, "CAPABILITY", simulate(platform).capability)
    _check(vendor, _batch(**DECODE_BATCHES["sinks"]), "decode", simulate(platform))


def test_the_scales_reach_the_vendor_as_floats(vendor):
    # 16-bit caches: bmm1 is the softmax scale and bmm2 1.0, host floats (no device scales to fold).
    adapter.paged_attention(**_batch(**DECODE_BATCHES["fp16_scale"]))
    [call] = [c for c in vendor.decode.CALLS if c["entry"] == DECODE[0]]
    assert (call["bmm1_scale"], call["bmm2_scale"]) == (0.05, 1.0)
    assert all(type(call[name]) is float for name in ("bmm1_scale", "bmm2_scale"))


def test_the_window_and_soft_cap_reach_the_vendor_as_flashinfer_spells_them(vendor):
    adapter.paged_attention(**_batch(**DECODE_BATCHES["window_across_pages"]))
    assert [c["window_left"] for c in vendor.decode.CALLS if c["entry"] == DECODE[0]] == [31]
    adapter.paged_attention(**_batch(**PREFILL_BATCHES["soft_cap_window_fp16"]))
    adapter.paged_attention(**_batch(**PREFILL_BATCHES["non_causal"]))
    plans = [c for c in vendor.prefill.CALLS if c["entry"] == PREFILL[0]]
    assert [(p["window_left"], p["logits_soft_cap"], p["causal"]) for p in plans] == [(3, 3.0, True), (-1, None, False)]
    assert plans[0]["sm_scale"] == 0.6 and plans[0]["q_data_type"] == plans[0]["kv_data_type"] == torch.float16


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["prefill on fa3", "prefill on fa2"])
def test_views_of_a_packed_qkv_and_a_joint_kv_cache(vendor, monkeypatch, capability):
    # The query as a slice of a packed qkv projection, the caches as halves of vLLM's joint
    # [num_blocks, 2, block_size, Hkv, D] tensor: unit stride along D, other strides arbitrary but
    # the same for K and V, so xqa and fa2, which address V with K's strides, read V right.
    monkeypatch.setattr(vendor.prefill, "CAPABILITY", capability)  # (8, 0): the wrapper picks fa2
    for name, batch, path in (("decode", DECODE_BATCHES["sinks"], "decode"),
                              ("prefill", PREFILL_BATCHES["mixed_with_a_sequence_without_queries"], "prefill")):
        kwargs = _batch(seed=4, **batch)
        query, k_cache = kwargs["query"], kwargs["k_cache"]
        heads, kv_heads = query.shape[1], k_cache.shape[2]
        qkv = torch.randn(query.shape[0], heads + 2 * kv_heads, query.shape[2]).to(query.dtype)
        qkv[:, :heads] = query
        joint = torch.stack([k_cache, kwargs["v_cache"]], dim=1)
        views = dict(query=qkv[:, :heads], k_cache=joint[:, 0], v_cache=joint[:, 1])
        assert not any(v.is_contiguous() for v in views.values()), name
        assert views["k_cache"].stride() == views["v_cache"].stride() != k_cache.stride(), name
        _check(vendor, {**kwargs, **views}, path)


def _apart(kwargs):
    """``kwargs`` with k_cache contiguous and v_cache a half of a joint [num_blocks, 2, ...] tensor:
    both valid (unit stride along D), with different strides."""
    joint = torch.stack([torch.zeros_like(kwargs["v_cache"]), kwargs["v_cache"]], dim=1)
    assert joint[:, 1].stride() != kwargs["k_cache"].stride()
    return {**kwargs, "v_cache": joint[:, 1]}


@pytest.mark.parametrize("batch, platform", [
    (DECODE_BATCHES["sinks"], "sm_90"),                                    # xqa
    (DECODE_BATCHES["sinks"], "sm_100"),
    (PREFILL_BATCHES["non_causal"], "sm_80"),                              # fa2
    (PREFILL_BATCHES["mixed_with_a_sequence_without_queries"], "sm_90"),   # fa3
])
def test_caches_with_different_strides_are_declined(batch, platform):
    # xqa (xqa_wrapper.cu) and the fa2 prefill (batch_prefill.cu) address V with K's strides: a V of
    # other strides would be read wrong (xqa) or refused (fa2), so supports declines every such call.
    kwargs = _apart(_batch(seed=7, **batch))
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate(platform)) == \
        "k_cache and v_cache with the same strides only (xqa and fa2 address both with K's)"
    # The same strides but not K's layout (both halves of a joint tensor) are taken.
    joint = torch.stack([kwargs["k_cache"], kwargs["v_cache"]], dim=1)
    assert ask(adapter.supports, spec.SPEC, {**kwargs, "k_cache": joint[:, 0], "v_cache": joint[:, 1]},
               simulate(platform)) is None


def test_one_prefill_wrapper_is_planned_at_every_call(vendor):
    first = _batch(seed=5, **PREFILL_BATCHES["sliding_window"])
    second = _batch(seed=6, **PREFILL_BATCHES["block_size_1"])
    for kwargs in (first, second, first):
        spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    assert _entries(vendor.prefill) == ["BatchPrefillWithPagedKVCacheWrapper"] + PREFILL * 3


def test_prefill_refuses_capture_and_decode_does_not(vendor, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=f"flashinfer's paged prefill: {re.escape(_paged.HOST_PLAN)}"):
        adapter.paged_attention(**_batch(**PREFILL_BATCHES["non_causal"]))
    assert vendor.prefill.CALLS == []
    _check(vendor, _batch(**DECODE_BATCHES["sinks"]), "decode")  # xqa reads the block table itself


def test_capture_check_declares_prefill_and_not_decode():
    # The engine runs another implementation for a prefill batch captured in a CUDA graph.
    assert _paged.HOST_PLAN in ask(adapter.capture_check, spec.SPEC, _batch(**PREFILL_BATCHES["non_causal"]), SM90)
    assert ask(adapter.capture_check, spec.SPEC, _batch(**DECODE_BATCHES["sinks"]), SM90) is None


def _kwargs(q_lens=(1, 1), kv_lens=(20, 9), num_heads=8, num_kv_heads=2, head_dim=64, **options):
    return _batch(q_lens, kv_lens, num_heads, num_kv_heads, head_dim, **options)


def _strided(tensor):
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    return wide[..., ::2]


PREFILL_SHAPE = dict(q_lens=(3, 1), kv_lens=(20, 9))


@pytest.mark.parametrize("changes, platform, reason", [
    # decode_reason
    ({}, "sm_80", "xqa runs on sm_90, sm_100, sm_120, not sm_80"),
    ({}, "sm_89", "xqa runs on sm_90, sm_100, sm_120, not sm_89"),
    (dict(cache_dtype=FP8, scales=(0.5, 0.25)), "sm_90",
     "a cache of the query's dtype only (xqa's fp8 path computes in e4m3), got torch.float8_e4m3fn"),
    (dict(cache_dtype=FP8, dtype=torch.float16), "sm_100",
     "a cache of the query's dtype only (xqa's fp8 path computes in e4m3), got torch.float8_e4m3fn"),
    (dict(q_lens=(1, 0, 1), kv_lens=(20, 9, 4)), "sm_90",
     "one query per sequence only (xqa reads B * 1 query rows); this batch has sequences with none"),
    (dict(block_size=8), "sm_90", "block sizes [16, 32, 64, 128] only (xqa's page sizes), got 8"),
    (dict(block_size=256), "sm_90", "block sizes [16, 32, 64, 128] only (xqa's page sizes), got 256"),
    (dict(head_dim=40), "sm_90", "head dims that are multiples of 16 in [16, 256] only (xqa), got 40"),
    (dict(head_dim=8), "sm_90", "head dims that are multiples of 16 in [16, 256] only (xqa), got 8"),
    (dict(head_dim=272), "sm_90", "head dims that are multiples of 16 in [16, 256] only (xqa), got 272"),
    (dict(num_heads=64, num_kv_heads=1), "sm_90", "up to 32 query heads per kv head (xqa), got 64"),
    (dict(logits_soft_cap=30.0), "sm_90", "no logits soft cap (xqa has none)"),
    # prefill_reason
    (PREFILL_SHAPE, "sm_75", "BatchPrefillWithPagedKVCacheWrapper needs sm_80 or newer, not sm_75"),
    (dict(PREFILL_SHAPE, cache_dtype=FP8), "sm_90",
     "a cache of the query's dtype only for prefill batches, got torch.float8_e4m3fn"),
    (dict(PREFILL_SHAPE, head_dim=32), "sm_90", "head dims [64, 128, 256] only for prefill batches, got 32"),
    (dict(PREFILL_SHAPE, head_dim=96), "sm_90", "head dims [64, 128, 256] only for prefill batches, got 96"),
    (dict(PREFILL_SHAPE, with_sinks=True), "sm_90",
     "no sinks in prefill batches (not wired: the wrapper's run takes them, unconfirmed here)"),
])
def test_supports_declines_by_name(changes, platform, reason):
    assert reason in ask(adapter.supports, spec.SPEC, _kwargs(**changes), simulate(platform))


@pytest.mark.parametrize("name", ["query", "k_cache", "v_cache"])
def test_a_head_dim_that_is_not_unit_stride_is_declined(name):
    kwargs = _kwargs()
    kwargs[name] = _strided(kwargs[name])
    assert f"{name} needs a unit stride along the head dim" in ask(adapter.supports, spec.SPEC, kwargs, SM90)


def test_declines_the_spec_cannot_reach():
    # The spec takes bf16/fp16 queries and caches of the query's dtype or fp8 only; supports still
    # names the rest should the spec ever widen.
    key = spec.SPEC.validate(**_kwargs())
    assert adapter.supports(key._replace(query_dtype=torch.float32), SM90) == \
        "bf16 or fp16 queries only, got torch.float32"
    assert adapter.supports(key._replace(cache_dtype=torch.float16), SM90) == \
        "a cache of the query's dtype only (xqa's fp8 path computes in e4m3), got torch.float16"
    prefill = spec.SPEC.validate(**_kwargs(**PREFILL_SHAPE))
    assert adapter.supports(prefill._replace(cache_dtype=torch.float16), SM90) == \
        "a cache of the query's dtype only for prefill batches, got torch.float16"


@pytest.mark.parametrize("changes, platform", [
    ({}, "sm_90"), ({}, "sm_100"), ({}, "sm_120"),                       # decode on xqa
    (dict(sliding_window=4, with_sinks=True), "sm_90"),                   # window and sinks on decode
    (PREFILL_SHAPE, "sm_80"), (dict(PREFILL_SHAPE, logits_soft_cap=5.0), "sm_90"),
    (dict(q_lens=(0, 0)), "sm_75"),                                       # no queries: nothing to decline
])
def test_supports_accepts(changes, platform):
    assert ask(adapter.supports, spec.SPEC, _kwargs(**changes), simulate(platform)) is None


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    decode = reversed_signature(fake["flashinfer/decode.py"], "trtllm_batch_decode_with_kv_cache")
    prefill = fake["flashinfer/prefill.py"]
    for method in ("__init__", "plan"):
        prefill = reversed_signature(prefill, method)
    assert "    bmm2_scale=1.0,\n    bmm1_scale=1.0," in decode
    _install(monkeypatch, tmp_path, files={**fake, "flashinfer/decode.py": decode, "flashinfer/prefill.py": prefill})
    assert FLASHINFER.problem() is None
    monkeypatch.setattr(_paged, "_wrappers", {})
    vendor = SimpleNamespace(decode=importlib.import_module("flashinfer.decode"),
                             prefill=importlib.import_module("flashinfer.prefill"))
    _check(vendor, _batch(**DECODE_BATCHES["window_sinks_page_64"]), "decode")
    _check(vendor, _batch(**PREFILL_BATCHES["soft_cap_window_fp16"]), "prefill")


@pytest.mark.parametrize("path, drop, reason", [
    ("flashinfer/prefill.py", "        window_left=-1,\n",
     "flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper.plan takes no keyword window_left"),
    ("flashinfer/decode.py", "    sinks=None,\n    kv_layout=\"HND\",\n",
     "flashinfer.decode.trtllm_batch_decode_with_kv_cache takes no keyword sinks, kv_layout"),
])
def test_a_vendor_missing_a_keyword_is_quarantined(monkeypatch, tmp_path, path, drop, reason):
    fake = sources("flashinfer")
    assert fake[path].count(drop) == 1
    _install(monkeypatch, tmp_path, files={**fake, path: fake[path].replace(drop, "")})
    assert reason in FLASHINFER.problem_for(CALLS["paged_attention"])
    assert FLASHINFER.problem_for(CALLS["paged_attention"]).startswith("flashinfer-python 0.6.14: ")
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    rejected = {impl.backend: why for impl, why in engine.tables["paged_attention"].rejected}
    assert reason in rejected["flashinfer"]
    for op in ("mla_decode", "grouped_topk"):  # the vendor's other ops still serve
        assert "flashinfer" in {c.impl.backend for c in engine.tables[op].candidates}, op


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["paged_attention"].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith(
        "flashinfer-python 0.6.14: decode of 16-bit caches: xqa (trtllm_batch_decode_with_kv_cache)")
    assert impl.fn is adapter.paged_attention and impl.supports is adapter.supports
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["paged_attention"].rejected}
    assert "needs a cuda platform" in on_cpu["flashinfer"]


def test_the_first_call_per_variant_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    decode, prefill = _batch(**DECODE_BATCHES["sinks"]), _batch(**PREFILL_BATCHES["non_causal"])
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        for kwargs in (decode, decode, prefill, prefill):
            adapter.paged_attention(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert re.search(r"paged_attention: first call for \('decode', .* may compile", messages[0])
    assert "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" in messages[0] and "took" in messages[1]
    assert re.search(r"first call for \('prefill', .* may compile", messages[2]) and "took" in messages[3]
    assert list(_vendor.first_calls.seconds()) == [
        ("flashinfer", "paged_attention", ("decode", torch.bfloat16, 32, 128, 4, False)),
        ("flashinfer", "paged_attention", ("prefill", torch.bfloat16, 64, False, False)),
    ]
    # Every call after the first went to the vendor too.
    assert len([c for c in vendor.decode.CALLS if c["entry"] == DECODE[0]]) == 2
    assert _entries(vendor.prefill, PREFILL[1]) == [PREFILL[1]] * 2


def test_metadata_plans_prefill_batches_only(vendor):
    assert adapter.metadata(_batch(**DECODE_BATCHES["sinks"])) is None  # xqa reads the block table
    assert adapter.metadata(CASES["no_queries"].build()) is None
    assert vendor.prefill.CALLS == [] and vendor.decode.CALLS == []
    kwargs = _batch(**PREFILL_BATCHES["sliding_window"])
    planned = adapter.metadata(kwargs)
    assert type(planned).__name__ == "BatchPrefillWithPagedKVCacheWrapper"
    assert _entries(vendor.prefill) == ["BatchPrefillWithPagedKVCacheWrapper", PREFILL[0]]
    assert vendor.prefill.CALLS[1]["window_left"] == 4
    _check(vendor, kwargs, "prefill")  # the call plans again, on the same wrapper


def test_the_fakes_refuse_what_flashinfer_refuses(vendor, monkeypatch):
    # The fakes are only worth their checks: the ones the adapter's arguments must pass.
    kwargs = _batch(**DECODE_BATCHES["sinks"])
    decode = dict(query=kwargs["query"], kv_cache=(kwargs["k_cache"], kwargs["v_cache"]),
                  workspace_buffer=_paged.workspace(torch.device("cpu"), "decode"),
                  block_tables=kwargs["block_table"], seq_lens=kwargs["seq_lens"].view(torch.uint32),
                  max_seq_len=kwargs["max_seq_len"], kv_layout="NHD")
    vendor.decode.trtllm_batch_decode_with_kv_cache(**decode)
    for changes, error in ((dict(seq_lens=kwargs["seq_lens"]), "seq_lens: uint32"),
                           (dict(block_tables=kwargs["block_table"].long()), "page_table: contiguous int32"),
                           (dict(workspace_buffer=torch.zeros(16 << 20)), "workspace_buffer: torch.float32"),
                           (dict(kv_layout="HND"), "Invalid page_size: 2"),  # NHD caches read as HND
                           (dict(bmm1_scale=torch.tensor([0.1], dtype=torch.float64)), "q_scale: a 1-element fp32")):
        with pytest.raises((TypeError, ValueError), match=error):
            vendor.decode.trtllm_batch_decode_with_kv_cache(**{**decode, **changes})
    # "auto" is xqa on sm_90 (above) and trtllm-gen on sm_100, as the shipped one picks it.
    vendor.decode.CALLS.clear()
    monkeypatch.setattr(vendor.decode, "CAPABILITY", (10, 0))
    with pytest.raises(NotImplementedError, match="not trtllm-gen"):
        vendor.decode.trtllm_batch_decode_with_kv_cache(**decode)
    vendor.decode.trtllm_batch_decode_with_kv_cache(**decode, backend="xqa")
    assert [c["backend"] for c in vendor.decode.CALLS if c["entry"] == DECODE[0]] == ["trtllm-gen", "xqa"]
    prefill = vendor.prefill.BatchPrefillWithPagedKVCacheWrapper(_paged.workspace(torch.device("cpu"), "prefill"))
    query, caches = kwargs["query"], (kwargs["k_cache"], kwargs["v_cache"])
    with pytest.raises(AttributeError):  # run() before plan()
        prefill.run(query, caches)
    pages = _paged.page_lists(kwargs["block_table"], kwargs["seq_lens"], 32)
    plan = dict(qo_indptr=kwargs["cu_seqlens_q"], paged_kv_indptr=pages.indptr, paged_kv_indices=pages.indices,
                paged_kv_last_page_len=pages.last_page_len, num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                page_size=32, q_data_type=torch.float16)
    prefill.plan(**plan)
    with pytest.raises(ValueError, match="does not match the q_data_type"):
        prefill.run(query, caches)  # bf16 after an fp16 plan
    with pytest.raises(TypeError, match="paged_kv_indptr: int32"):
        prefill.plan(**{**plan, "paged_kv_indptr": pages.indptr.long()})
    with pytest.raises(ValueError, match="paged_kv_last_page_len"):
        prefill.plan(**{**plan, "paged_kv_last_page_len": pages.last_page_len + 32})
