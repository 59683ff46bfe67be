"""The aiter backend's mla_decode against the fake aiter (tests/vendors/aiter/mla.py: mla_decode_fwd's
signature, the non-persistent asm path's checks and kernel table, attention in fp64 over the rows its
CSR lists name): results against the spec's reference, the per-token page lists, declines by name."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS
from kernelmux.backends.aiter import mla_decode as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import mla_decode as spec
from vendors import reversed_signature, sources

CASES = {case.name: case for case in spec.SPEC.cases}


def _without_lse(name, seed=1):
    """A spec case with return_lse False (the adapter declines lse; the data and shapes are the case's)."""
    return {**CASES[name].build(seed=seed), "return_lse": False}


def _check(kwargs, arch="gfx942"):
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate(arch)) is None
    spec.SPEC.check_close(adapter.mla_decode(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("name", [
    "deepseek_v3_h16_decode_b8_ctx512",     # DeepSeek-V3 at TP8
    "deepseek_v3_h128_decode_b1_ctx512",    # 128 heads (TP1)
    "deepseek_v3_h16_mtp2_b8_ctx4096",      # MTP: 2 causal queries per sequence
    "deepseek_v3_h128_mtp4_b8_ctx512",      # 3 draft tokens
    "deepseek_v3_h16_decode_no_lse",
    "seq_len_1",                            # each query sees only its own row
    "table_slack_permuted",                 # unused table entries point at random blocks
    "empty_batch",
])
def test_the_spec_cases_match_the_reference(gfx942, name):
    kwargs = _without_lse(name)
    _check(kwargs)
    calls = sys.modules["aiter.mla"].CALLS
    assert len(calls) == (1 if kwargs["q"].shape[0] else 0)
    if calls:
        assert calls[0]["page_size"] == 1 and calls[0]["causal"]


def test_unread_slots_holding_nan_stay_unread(gfx942):
    kwargs = _without_lse("table_slack_permuted")
    cache, table, lengths = kwargs["kv_cache"], kwargs["block_table"], kwargs["seq_lens"].tolist()
    read = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        read[table[b, positions // cache.shape[1]].long(), positions % cache.shape[1]] = True
    cache[~read] = float("nan")
    _check(kwargs)


def test_a_cache_of_wider_rows_is_read_in_place(gfx942):
    # Rows of 576 inside rows of 640: the block stride is a multiple of the row stride, so the cache is
    # still one strided array of token rows.
    kwargs = _without_lse("deepseek_v3_h16_decode_b8_ctx512")
    narrow = kwargs["kv_cache"]
    wide = torch.zeros(*narrow.shape[:2], 640, dtype=narrow.dtype)
    wide[..., :576] = narrow
    kwargs["kv_cache"] = wide[..., :576]
    _check(kwargs)
    lists = adapter.token_lists(kwargs["kv_cache"], kwargs["block_table"], kwargs["seq_lens"], kwargs["max_seq_len"])
    assert lists.kv_buffer.data_ptr() == wide.data_ptr() and lists.kv_buffer.stride(0) == 640


def test_64_heads_have_a_decode_kernel_on_gfx950_only(install_aiter):
    install_aiter("gfx950")
    kwargs = {**spec.SPEC.case("deepseek_v3_h16_decode_b8_ctx512").build(seed=2), "return_lse": False}
    kwargs["q"] = torch.randn(8, 64, 576, dtype=torch.bfloat16)
    _check(kwargs, "gfx950")
    assert "64 heads: no non-persistent bf16 kernel on gfx942 (query lengths [2, 3, 4])" in \
        ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942"))


def test_token_lists_name_every_position_in_order():
    kwargs = _without_lse("table_slack_permuted")
    cache, table, lengths = kwargs["kv_cache"], kwargs["block_table"], kwargs["seq_lens"]
    lists = adapter.token_lists(cache, table, lengths, kwargs["max_seq_len"])
    size = cache.shape[1]
    expected = [int(table[b, j // size]) * size + j % size for b, n in enumerate(lengths.tolist()) for j in range(n)]
    used = int(lists.kv_indptr[-1])
    assert lists.kv_indptr.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert lists.kv_indices[:used].tolist() == expected
    assert lists.kv_last_page_lens.tolist() == [1] * len(lengths)
    assert lists.kv_buffer.shape == (cache.shape[0] * size, 1, 1, 576)
    assert torch.equal(lists.kv_buffer[expected[5], 0, 0], cache[table[0, 5 // size], 5 % size])


@pytest.mark.parametrize("name, arch, reason", [
    ("deepseek_v3_h16_decode_b8_ctx512", "gfx942", "no lse"),
    ("deepseek_v3_h16_fp8_decode_b8_ctx4096", "gfx942", "bf16 q and cache only"),
    ("small_mtp_fp16", "gfx942", "rows of 576 with kv_lora_rank 512 only"),
    ("deepseek_v3_h16_mtp_mixed", "gfx942", "every sequence with max_query_len queries only"),
])
def test_supports_declines_by_name(name, arch, reason):
    kwargs = CASES[name].build(seed=1)
    if reason != "no lse":
        kwargs["return_lse"] = False
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, simulate(arch))


def test_query_lengths_without_a_kernel_are_declined():
    kwargs = _without_lse("deepseek_v3_h16_decode_b8_ctx512")
    kwargs["q"] = torch.randn(8, 8, 576, dtype=torch.bfloat16)  # 8 heads, one query: gfx942 has it
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942")) is None
    two = {**kwargs, "q": torch.randn(16, 8, 576, dtype=torch.bfloat16), "max_query_len": 2,
           "cu_seqlens_q": torch.arange(0, 17, 2, dtype=torch.int32)}
    assert "2 queries per sequence with 8 heads: no non-persistent bf16 kernel on gfx942" in \
        ask(adapter.supports, spec.SPEC, two, simulate("gfx942"))
    assert ask(adapter.supports, spec.SPEC, two, simulate("gfx950")) is None


def test_32_heads_are_declined_on_gfx950():
    kwargs = _without_lse("deepseek_v3_h16_decode_b8_ctx512")
    kwargs["q"] = torch.randn(8, 32, 576, dtype=torch.bfloat16)
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx942")) is None
    assert "mishandles ragged tails with split KV" in ask(adapter.supports, spec.SPEC, kwargs, simulate("gfx950"))


def test_the_vendor_is_called_by_keyword(install_aiter):
    fake = sources("aiter")
    install_aiter(files={**fake, "aiter/mla.py": reversed_signature(fake["aiter/mla.py"], "mla_decode_fwd")})
    assert AITER.problem_for(CALLS["mla_decode"]) is None
    _check(_without_lse("deepseek_v3_h16_decode_b8_ctx512"))
