"""The flashinfer backend's mla_decode against a fake flashinfer that holds the shipped signatures,
checks and layouts (tests/vendors/flashinfer/mla): the adapter's results against the spec's reference
(decode, MTP, with and without lse, c_kv / k_pe views), its declines (fp8 caches among them), keyword
calls, plan per call, capture refusal, and the vendor mechanism's quarantine and first-call log. On a
GPU with flashinfer installed, tests/backends/test_conformance.py runs the real one against the reference."""

from __future__ import annotations

import importlib
import logging
import re

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER, _paged
from kernelmux.backends.flashinfer import mla_decode as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import mla_decode as spec
from vendors import install_fake, reversed_signature, sources

FP8 = torch.float8_e4m3fn
SM90 = simulate("sm_90")
RUN = "BatchMLAPagedAttentionWrapper.run"


def _install(monkeypatch, tmp_path, version="0.6.14", files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", version, files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    monkeypatch.setattr(_paged, "_wrappers", {})  # a wrapper of an earlier test's fake must not serve
    return importlib.import_module("flashinfer.mla")


def _batch(q_lens, kv_lens, num_heads, seed=0, **options):
    options.setdefault("scale", spec.DEEPSEEK_V3_SCALE)
    return spec._maker(tuple(q_lens), tuple(kv_lens), num_heads, **options)(
        torch.device("cpu"), torch.Generator().manual_seed(seed))


def _check(vendor, kwargs):
    assert ask(adapter.supports, spec.SPEC, kwargs, SM90) is None
    vendor.CALLS.clear()
    spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    runs = [call for call in vendor.CALLS if call["entry"] == RUN]
    assert len(runs) == (1 if kwargs["q"].shape[0] else 0)
    return runs


# The spec's cases FlashInfer takes on sm_90 that stay fast on a 2-core CPU; its DeepSeek-V3 decode
# grid (B up to 64, context up to 4096, 128 heads) is the GPU conformance run's.
SPEC_CASES = ["deepseek_v3_h16_decode_b1_ctx512", "deepseek_v3_h16_mtp_mixed",
              "empty_batch", "seq_len_1", "partial_blocks", "table_slack_permuted", "nan_in_unused_slots"]
SPEC_DECLINED = {  # the spec's random and edge cases FlashInfer declines on sm_90, and why
    "small_decode": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 40 and 32",
    "small_mtp_fp16": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 24 and 16",
    "small_fp8": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 40 and 32",
    "small_fp8_no_scale": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 24 and 16",
    "small_no_rope": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 16 and 16",
    "block_size_1": "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 24 and 16",
}
CASES = {case.name: case for case in spec.SPEC.cases}


@pytest.mark.parametrize("name", SPEC_CASES)
def test_the_spec_cases_match_the_reference(vendor, name):
    _check(vendor, CASES[name].build(seed=1))


def test_every_small_spec_case_is_taken_or_declined_by_name():
    small = {case.name for case in spec.SPEC.cases if case.tags & {"random", "edge"}}
    assert small <= set(SPEC_CASES) | set(SPEC_DECLINED), "a new small case: add it above"
    for name, reason in SPEC_DECLINED.items():
        assert reason in ask(adapter.supports, spec.SPEC, CASES[name].build(), SM90), name


BATCHES = {
    "decode_block_16": dict(q_lens=(1, 1, 1), kv_lens=(1, 40, 17), num_heads=8, block_size=16),
    "mtp3_causal": dict(q_lens=(3, 3), kv_lens=(3, 130), num_heads=4),
    "mtp_varlen_block_32": dict(q_lens=(2, 1, 4), kv_lens=(33, 70, 4), num_heads=2, block_size=32),
    "fp16": dict(q_lens=(1, 2), kv_lens=(65, 9), num_heads=4, dtype=torch.float16),
    "mtp_no_lse_block_8": dict(q_lens=(2, 2), kv_lens=(7, 64), num_heads=4, block_size=8, return_lse=False),
    "long_and_short": dict(q_lens=(1, 1), kv_lens=(300, 1), num_heads=4, table_slack=4),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_batches_match_the_reference(vendor, name):
    kwargs = _batch(seed=2, **BATCHES[name])
    [run] = _check(vendor, kwargs)
    assert run["return_lse"] is kwargs["return_lse"] and run["return_lse_base_on_e"] is True  # natural log


@pytest.mark.parametrize("return_lse", [True, False])
def test_lse_on_and_off(vendor, return_lse):
    kwargs = _batch(seed=3, **{**BATCHES["mtp3_causal"], "return_lse": return_lse})
    out, lse = adapter.mla_decode(**kwargs)
    assert out.shape == (6, 4, 512) and out.dtype == torch.bfloat16
    assert lse.dtype == torch.float32 and lse.shape == ((6, 4) if return_lse else (0,))
    spec.SPEC.check_close((out, lse), spec.SPEC.reference(**kwargs), kwargs)


def test_the_cache_is_read_through_c_kv_and_k_pe_views(vendor):
    # No copy of the latent cache: the wrapper gets its two column ranges, rows 576 apart, even when
    # the cache and q are themselves views of wider buffers (a row pitch of 640).
    kwargs = _batch(seed=4, **BATCHES["mtp_varlen_block_32"])
    cache, q = kwargs["kv_cache"], kwargs["q"]
    wide_cache = torch.full((*cache.shape[:2], 640), float("nan"), dtype=cache.dtype)
    wide_cache[..., :576] = cache
    wide_q = torch.full((*q.shape[:2], 640), float("nan"), dtype=q.dtype)
    wide_q[..., :576] = q
    for views in ({}, dict(kv_cache=wide_cache[..., :576], q=wide_q[..., :576])):
        [run] = _check(vendor, {**kwargs, **views})
        pitch = 640 if views else 576
        assert run["ckv_strides"] == run["kpe_strides"] == (32 * pitch, pitch, 1)


def test_one_wrapper_is_planned_at_every_call(vendor):
    first, second = _batch(seed=5, **BATCHES["fp16"]), _batch(seed=6, **BATCHES["mtp3_causal"])
    for kwargs in (first, second, first):
        spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    entries = [call["entry"] for call in vendor.CALLS]
    assert entries == ["BatchMLAPagedAttentionWrapper"] + ["BatchMLAPagedAttentionWrapper.plan", RUN] * 3
    plans = [call for call in vendor.CALLS if call["entry"] == "BatchMLAPagedAttentionWrapper.plan"]
    assert [(p["causal"], p["page_size"], p["q_data_type"]) for p in plans] == [
        (True, 64, torch.float16), (True, 64, torch.bfloat16), (True, 64, torch.float16)]


def test_the_wrapper_refuses_capture(vendor, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=re.escape(f"flashinfer's MLA wrapper: {_paged.HOST_PLAN}")):
        adapter.mla_decode(**_batch(**BATCHES["fp16"]))
    assert vendor.CALLS == []


@pytest.mark.parametrize("platform, capturable", [("sm_90", False), ("sm_80", False), ("sm_100", True),
                                                   ("sm_120", True)])
def test_capture_check_follows_the_entry_point(platform, capturable):
    # The wrapper (sm_80/sm_90) plans per call; the trtllm entry points (sm_100, sm_120) plan nothing.
    reason = ask(adapter.capture_check, spec.SPEC, _batch(**BATCHES["fp16"]), simulate(platform))
    assert (reason is None) == capturable
    assert capturable or _paged.HOST_PLAN in reason


def _kwargs(**changes):
    return _batch(**{**dict(q_lens=(1, 2), kv_lens=(9, 20), num_heads=4), **changes})


def _strided(tensor):
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    return wide[..., ::2]


@pytest.mark.parametrize("changes, platform, reason", [
    ({}, "sm_75", "BatchMLAPagedAttentionWrapper needs sm_80 or newer, not sm_75"),
    (dict(head_dim=40, kv_lora_rank=32), "sm_90",
     "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 40 and 32"),
    (dict(kv_lora_rank=448), "sm_90", "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 576 and 448"),
    (dict(head_dim=640), "sm_90", "rows of 576 with kv_lora_rank 512 only (DeepSeek MLA), got 640 and 512"),
    # The fp8 path (fa3, sm_90, bf16 q) disagreed with the reference's lse on the H100.
    (dict(cache_dtype=FP8, kv_scale=0.5), "sm_90",
     "a cache of q's dtype (torch.bfloat16) only; fp8 caches disagree with the reference, got torch.float8_e4m3fn"),
    (dict(cache_dtype=FP8), "sm_100", "fp8 caches disagree with the reference, got torch.float8_e4m3fn"),
    (dict(cache_dtype=FP8, q_lens=(1, 1), num_heads=128, return_lse=False), "sm_120",
     "fp8 caches disagree with the reference, got torch.float8_e4m3fn"),
    (dict(cache_dtype=FP8, dtype=torch.float16), "sm_90",
     "a cache of q's dtype (torch.float16) only; fp8 caches disagree with the reference"),
])
def test_supports_declines_by_name(changes, platform, reason):
    assert reason in ask(adapter.supports, spec.SPEC, _kwargs(**changes), simulate(platform))


@pytest.mark.parametrize("name", ["q", "kv_cache"])
def test_a_last_dim_that_is_not_unit_stride_is_declined(name):
    kwargs = _kwargs()
    kwargs[name] = _strided(kwargs[name])
    assert f"{name} needs a unit stride along its last dim" in ask(adapter.supports, spec.SPEC, kwargs, SM90)


def test_declines_the_spec_cannot_reach():
    key = spec.SPEC.validate(**_kwargs())
    assert adapter.supports(key._replace(q_dtype=torch.float32), SM90) == "bf16 or fp16 q only, got torch.float32"
    assert adapter.supports(key._replace(cache_dtype=torch.float16), SM90) == \
        "a cache of q's dtype (torch.bfloat16) only; fp8 caches disagree with the reference, got torch.float16"


@pytest.mark.parametrize("changes, platform", [
    ({}, "sm_80"), ({}, "sm_90"), (dict(return_lse=False), "sm_100"), (dict(q_lens=(2, 2)), "sm_100"),
    (dict(q_lens=(1, 1), num_heads=128, return_lse=False), "sm_120"),
    (dict(dtype=torch.float16), "sm_90"),
    (dict(block_size=1), "sm_90"), (dict(q_lens=(4, 4), kv_lens=(4, 20)), "sm_90"),
])
def test_supports_accepts(changes, platform):
    assert ask(adapter.supports, spec.SPEC, _kwargs(**changes), simulate(platform)) is None


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    mla = fake["flashinfer/mla/__init__.py"]
    for method in ("__init__", "plan", "run"):
        mla = reversed_signature(mla, method)
    assert "        kpe_cache,\n        ckv_cache,\n        q_pe,\n        q_nope," in mla
    _install(monkeypatch, tmp_path, files={**fake, "flashinfer/mla/__init__.py": mla})
    assert FLASHINFER.problem() is None
    monkeypatch.setattr(_paged, "_wrappers", {})
    vendor = importlib.import_module("flashinfer.mla")
    _check(vendor, _batch(**BATCHES["mtp_no_lse_block_8"]))
    _check(vendor, _batch(**BATCHES["mtp_varlen_block_32"]))


def test_a_vendor_missing_a_keyword_is_quarantined(monkeypatch, tmp_path):
    # A release whose run() returns its lse in base 2 only.
    fake = sources("flashinfer")
    path = "flashinfer/mla/__init__.py"
    drop = "        return_lse_base_on_e=False,\n"
    assert fake[path].count(drop) == 1
    _install(monkeypatch, tmp_path, files={**fake, path: fake[path].replace(drop, "")})
    reason = "flashinfer.mla.BatchMLAPagedAttentionWrapper.run takes no keyword return_lse_base_on_e"
    assert reason in FLASHINFER.problem_for(CALLS["mla_decode"])
    rejected = {impl.backend: why for impl, why in
                Engine(ALL_SPECS, Settings(platform="sm_90")).tables["mla_decode"].rejected}
    assert reason in rejected["flashinfer"]


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["mla_decode"].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith("flashinfer-python 0.6.14: BatchMLAPagedAttentionWrapper")
    assert impl.fn is adapter.mla_decode and impl.supports is adapter.supports
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["mla_decode"].rejected}
    assert "needs a cuda platform" in on_cpu["flashinfer"]


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    kwargs = _batch(**BATCHES["fp16"])
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        adapter.mla_decode(**kwargs)
        adapter.mla_decode(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "mla_decode: first call for (torch.float16, torch.float16, 4) on " \
        in messages[0] and "took" in messages[1]
    assert list(_vendor.first_calls.seconds()) == [("flashinfer", "mla_decode", (torch.float16, torch.float16, 4))]
    assert [call["entry"] for call in vendor.CALLS].count(RUN) == 2


def test_metadata_plans_the_wrapper_for_the_bench(vendor):
    kwargs = _batch(**BATCHES["mtp3_causal"])
    planned = adapter.metadata(kwargs)
    assert type(planned).__name__ == "BatchMLAPagedAttentionWrapper"
    assert [call["entry"] for call in vendor.CALLS] == ["BatchMLAPagedAttentionWrapper",
                                                        "BatchMLAPagedAttentionWrapper.plan"]
    assert adapter.metadata(CASES["empty_batch"].build()) is None
    [run] = _check(vendor, kwargs)  # the call plans again, on the same wrapper
    assert [call["entry"] for call in vendor.CALLS] == ["BatchMLAPagedAttentionWrapper.plan", RUN]


def test_the_fake_refuses_what_flashinfer_refuses(vendor):
    kwargs = _batch(**{**BATCHES["mtp3_causal"], "cache_dtype": FP8, "kv_scale": 0.25})
    q, cache = kwargs["q"], kwargs["kv_cache"]
    mla = vendor.BatchMLAPagedAttentionWrapper(_paged.workspace(torch.device("cpu"), "mla"))
    views = dict(q_nope=q[..., :512], q_pe=q[..., 512:], ckv_cache=cache[..., :512], kpe_cache=cache[..., 512:],
                 return_lse=True, return_lse_base_on_e=True)
    with pytest.raises(AttributeError):  # run() before plan()
        mla.run(**views)
    pages = _paged.page_lists(kwargs["block_table"], kwargs["seq_lens"], 64)
    plan = dict(qo_indptr=kwargs["cu_seqlens_q"], kv_indptr=pages.indptr, kv_indices=pages.indices,
                kv_len_arr=kwargs["seq_lens"], num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=64,
                causal=True, sm_scale=kwargs["scale"], q_data_type=torch.bfloat16, kv_data_type=FP8)
    with pytest.raises(ValueError, match="only supports q_data_type=torch.bfloat16"):
        mla.plan(**{**plan, "q_data_type": torch.float16})
    mla.plan(**plan)
    with pytest.raises(ValueError, match="ckv_scale and kpe_scale are required"):
        mla.run(**views)
    with pytest.raises(ValueError, match="q_nope.dtype=torch.float16 does not match"):
        mla.run(**{**views, "q_nope": views["q_nope"].half()}, ckv_scale=0.25, kpe_scale=0.25)
    # Its fp8 math, for when the adapter takes fp8 again: the reference dequantizes the same way.
    spec.SPEC.check_close(mla.run(**views, ckv_scale=0.25, kpe_scale=0.25), spec.SPEC.reference(**kwargs), kwargs)
    mla.plan(**{**plan, "kv_data_type": torch.bfloat16})
    with pytest.raises(ValueError, match="ckv_cache.dtype=torch.float8_e4m3fn does not match"):
        mla.run(**views)


# sm_100/sm_103 and sm_120/sm_121: trtllm_batch_decode_with_kv_cache_mla on the block table, asked for
# by backend name; the fake picks and checks by the capability it is told, the adapter reads it through
# _capability (CPU tensors here, so both are set together).
TRTLLM = "trtllm_batch_decode_with_kv_cache_mla"
SM100, SM120 = simulate("sm_100"), simulate("sm_120")


@pytest.fixture
def on(vendor, monkeypatch):
    def device(platform):
        capability = simulate(platform).capability
        monkeypatch.setattr(vendor, "CAPABILITY", capability)
        monkeypatch.setattr(adapter, "_capability", lambda device: capability)
        vendor.CALLS.clear()
        return simulate(platform)
    return device


def _check_trtllm(vendor, kwargs, platform, backend):
    assert ask(adapter.supports, spec.SPEC, kwargs, platform) is None
    vendor.CALLS.clear()
    spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    assert all(call["entry"] == TRTLLM for call in vendor.CALLS), "no wrapper on this path"
    calls = vendor.CALLS
    assert len(calls) == (1 if kwargs["q"].shape[0] else 0)
    assert all(call["backend"] == backend for call in calls)
    return calls


SM100_BATCHES = {
    "decode_block_32_lse": dict(q_lens=(1, 1, 1), kv_lens=(1, 40, 97), num_heads=16, block_size=32),
    "decode_block_64_no_lse": dict(q_lens=(1, 1), kv_lens=(300, 7), num_heads=8, return_lse=False, table_slack=5),
    "mtp2_uniform_lse": dict(q_lens=(2, 2, 2), kv_lens=(2, 65, 130), num_heads=4, block_size=32),
    "mtp_varlen_no_lse": dict(q_lens=(2, 1, 2), kv_lens=(33, 70, 4), num_heads=4, return_lse=False, block_size=32),
}


@pytest.mark.parametrize("name", sorted(SM100_BATCHES))
def test_sm100_batches_take_trtllm_gen_and_match_the_reference(on, vendor, name):
    platform = on("sm_100")
    kwargs = _batch(seed=7, **SM100_BATCHES[name])
    [call] = _check_trtllm(vendor, kwargs, platform, "trtllm-gen")
    uniform = len(set(SM100_BATCHES[name]["q_lens"])) == 1
    assert call["cum_seq_lens_q"] is not uniform and call["return_lse"] is kwargs["return_lse"]
    assert (call["bmm1_scale"], call["bmm2_scale"]) == (kwargs["scale"], 1.0)
    assert type(call["bmm1_scale"]) is float
    # The table's width padded to a multiple of 128 / block_size, as _check_trtllm_gen_mla_shape asks.
    assert call["block_tables_shape"][1] % (128 // kwargs["kv_cache"].shape[1]) == 0
    if uniform:
        q_len = SM100_BATCHES[name]["q_lens"][0]
        assert call["query_shape"] == (len(SM100_BATCHES[name]["q_lens"]), q_len, kwargs["q"].shape[1], 576)
    else:
        assert call["max_q_len"] == kwargs["max_query_len"]


SM120_BATCHES = {
    "decode_block_16": dict(q_lens=(1, 1, 1), kv_lens=(1, 40, 17), num_heads=128, block_size=16, return_lse=False),
    "decode_block_128": dict(q_lens=(1, 1), kv_lens=(200, 129), num_heads=128, block_size=128, return_lse=False,
                             table_slack=1),
}


@pytest.mark.parametrize("name", sorted(SM120_BATCHES))
def test_sm120_batches_take_xqa_and_match_the_reference(on, vendor, name):
    platform = on("sm_120")
    kwargs = _batch(seed=8, **SM120_BATCHES[name])
    [call] = _check_trtllm(vendor, kwargs, platform, "xqa")
    assert call["query_shape"] == (kwargs["q"].shape[0], 1, 128, 576) and not call["cum_seq_lens_q"]


@pytest.mark.parametrize("platform, backend", [("sm_100", "trtllm-gen"), ("sm_120", "xqa")])
def test_the_spec_cases_either_match_or_are_declined(on, vendor, platform, backend):
    taken = 0
    for case in spec.SPEC.cases:
        if not case.tags & {"random", "edge"} and case.name not in SPEC_CASES:
            continue
        kwargs = case.build(seed=1)
        if ask(adapter.supports, spec.SPEC, kwargs, on(platform)) is None:
            _check_trtllm(vendor, kwargs, simulate(platform), backend)
            taken += 1
    # xqa takes 128 heads without lse only, which none of the small cases are (SM120_BATCHES are).
    assert taken >= (3 if platform == "sm_100" else 0)


def test_the_trtllm_path_plans_nothing_and_may_be_captured(on, vendor, monkeypatch):
    on("sm_100")
    kwargs = _batch(**SM100_BATCHES["mtp2_uniform_lse"])
    assert adapter.metadata(kwargs) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    assert [call["entry"] for call in vendor.CALLS] == [TRTLLM]
    assert vendor.CALLS[0]["workspace_buffer"] is _paged.workspace(torch.device("cpu"), "trtllm-mla")


def test_sm90_keeps_the_wrapper(on, vendor):
    platform = on("sm_90")
    kwargs = _batch(**BATCHES["mtp_varlen_block_32"])
    assert ask(adapter.supports, spec.SPEC, kwargs, platform) is None
    spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    assert [call["entry"] for call in vendor.CALLS] == ["BatchMLAPagedAttentionWrapper",
                                                        "BatchMLAPagedAttentionWrapper.plan", RUN]
    assert vendor.CALLS[0]["backend"] == "auto" and TRTLLM not in {call["entry"] for call in vendor.CALLS}


def _wide(tensor, pitch):
    wide = torch.zeros(*tensor.shape[:-1], pitch, dtype=tensor.dtype)
    wide[..., : tensor.shape[-1]] = tensor
    return wide[..., : tensor.shape[-1]]


@pytest.mark.parametrize("changes, platform, reason", [
    (dict(dtype=torch.float16), "sm_100", "'trtllm-gen'): bf16 q and cache only (its out is bf16), got torch.float16"),
    (dict(dtype=torch.float16, q_lens=(1, 1), num_heads=128), "sm_120",
     "'xqa'): bf16 q and cache only (its out is bf16), got torch.float16"),
    (dict(block_size=16), "sm_100", "trtllm-gen requires block_size in (32, 64), got 16"),
    (dict(block_size=128), "sm_100", "trtllm-gen requires block_size in (32, 64), got 128"),
    (dict(q_lens=(3, 3), kv_lens=(9, 20)), "sm_100", "up to 2 queries per sequence"),
    (dict(q_lens=(1, 2)), "sm_100", "no lse with varying queries per sequence (cum_seq_lens_q)"),
    (dict(q_lens=(1, 1)), "sm_120", "XQA MLA only supports 128 query heads, got 4"),
    (dict(q_lens=(1, 1), num_heads=128, block_size=8), "sm_120", "block_size in (16, 32, 64, 128) only, got 8"),
    (dict(q_lens=(1, 2), num_heads=128, return_lse=False), "sm_120",
     "XQA MLA only supports q_len_per_request == 1 (one query per sequence), got max_query_len 2, uniform False"),
    (dict(q_lens=(2, 2), num_heads=128, return_lse=False), "sm_120", "q_len_per_request == 1"),
    (dict(q_lens=(1, 1), num_heads=128), "sm_120", "XQA MLA backend does not support return_lse/lse output"),
])
def test_trtllm_declines_by_name(changes, platform, reason):
    assert reason in ask(adapter.supports, spec.SPEC, _kwargs(**changes), simulate(platform))


@pytest.mark.parametrize("platform", ["sm_100", "sm_120"])
def test_trtllm_declines_rows_tma_cannot_read(platform):
    kwargs = _kwargs(q_lens=(1, 1), num_heads=128, return_lse=False)
    kwargs["kv_cache"] = _wide(kwargs["kv_cache"], 580)[:, :, :576]  # 1160-byte rows: 8-byte aligned
    assert "kv_cache needs 16-byte aligned rows (TMA)" in ask(adapter.supports, spec.SPEC, kwargs, simulate(platform))
    assert ask(adapter.supports, spec.SPEC, kwargs, SM90) is None


def test_trtllm_reads_a_wider_cache_view(on, vendor):
    # 16-byte aligned rows 640 wide: the kernels take the cache's strides.
    platform = on("sm_100")
    kwargs = _batch(seed=9, **SM100_BATCHES["mtp2_uniform_lse"])
    kwargs["kv_cache"] = _wide(kwargs["kv_cache"], 640)
    kwargs["q"] = _wide(kwargs["q"], 640)
    _check_trtllm(vendor, kwargs, platform, "trtllm-gen")


def test_trtllm_is_called_by_keyword(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    mla = reversed_signature(fake["flashinfer/mla/__init__.py"], TRTLLM)
    assert "    max_q_len=None,\n    cum_seq_lens_q=None," in mla
    _install(monkeypatch, tmp_path, files={**fake, "flashinfer/mla/__init__.py": mla})
    assert FLASHINFER.problem() is None
    vendor = importlib.import_module("flashinfer.mla")
    for platform, backend, batch in (("sm_100", "trtllm-gen", SM100_BATCHES["mtp2_uniform_lse"]),
                                     ("sm_100", "trtllm-gen", SM100_BATCHES["mtp_varlen_no_lse"]),
                                     ("sm_120", "xqa", SM120_BATCHES["decode_block_16"])):
        capability = simulate(platform).capability
        monkeypatch.setattr(vendor, "CAPABILITY", capability)
        monkeypatch.setattr(adapter, "_capability", lambda device, capability=capability: capability)
        _check_trtllm(vendor, _batch(**batch), simulate(platform), backend)


def test_a_vendor_without_the_trtllm_keywords_is_quarantined(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    path = "flashinfer/mla/__init__.py"
    drop = "    cum_seq_lens_q=None,\n    max_q_len=None,\n"
    assert fake[path].count(drop) == 1
    _install(monkeypatch, tmp_path, files={**fake, path: fake[path].replace(drop, "").replace(
        "if max_q_len is not None and cum_seq_lens_q is None", "if False")})
    assert "flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla takes no keyword cum_seq_lens_q" in FLASHINFER.problem_for(CALLS["mla_decode"])


def test_the_fake_trtllm_refuses_what_flashinfer_refuses(on, vendor):
    on("sm_100")
    kwargs = _batch(**SM100_BATCHES["mtp2_uniform_lse"])
    table = torch.nn.functional.pad(kwargs["block_table"], (0, 4 - kwargs["block_table"].shape[1] % 4))
    call = dict(query=kwargs["q"].view(3, 2, 4, 576), kv_cache=kwargs["kv_cache"],
                workspace_buffer=_paged.workspace(torch.device("cpu"), "trtllm-mla"), qk_nope_head_dim=128,
                kv_lora_rank=512, qk_rope_head_dim=64, block_tables=table.int().contiguous(),
                seq_lens=kwargs["seq_lens"], max_seq_len=kwargs["max_seq_len"], bmm1_scale=kwargs["scale"])
    vendor.trtllm_batch_decode_with_kv_cache_mla(**call)
    for changes, error in ((dict(block_tables=table.int()[:, :-1].contiguous()), "block_num % \\(128 / block_size\\)"),
                           (dict(kv_cache=kwargs["kv_cache"][:, :16]), "block_size in \\(32, 64\\), got 16"),
                           (dict(max_q_len=2), "max_q_len is only supported when cum_seq_lens_q"),
                           (dict(bmm1_scale=torch.tensor([0.1], dtype=torch.float64)), "must have dtype torch.float32"),
                           (dict(query=kwargs["q"], cum_seq_lens_q=kwargs["cu_seqlens_q"], return_lse=True),
                            "does not support return_lse/lse with cum_seq_lens_q"),
                           (dict(query=kwargs["q"], cum_seq_lens_q=kwargs["cu_seqlens_q"], max_q_len=7),
                            "max_q_len cannot exceed"),
                           (dict(backend="xqa"), "XQA MLA requires SM120a")):
        with pytest.raises((TypeError, ValueError, NotImplementedError), match=error):
            vendor.trtllm_batch_decode_with_kv_cache_mla(**{**call, **changes})
    # "auto" is trtllm-gen on major 10 and xqa elsewhere, as the shipped one picks it.
    on("sm_120")
    with pytest.raises(ValueError, match="XQA MLA only supports q_len_per_request == 1"):
        vendor.trtllm_batch_decode_with_kv_cache_mla(**call)
    with pytest.raises(ValueError, match="only supports 128 query heads"):
        vendor.trtllm_batch_decode_with_kv_cache_mla(**{**call, "query": kwargs["q"][::2].view(3, 1, 4, 576)})
    assert [c["backend"] for c in vendor.CALLS] == ["xqa", "xqa"]
