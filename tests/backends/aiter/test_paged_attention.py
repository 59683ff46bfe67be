"""The aiter backend's paged_attention against the fake aiter (tests/vendors/aiter/ops/mha.py:
flash_attn_varlen_func's signature, the paged forwards' checks, attention in fp64 with the mask its
docstring defines): results against the spec's reference on block sizes of 128, declines by name."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS
from kernelmux.backends.aiter import paged_attention as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import paged_attention as spec
from vendors import reversed_signature, sources

CASES = {case.name: case for case in spec.SPEC.cases}
GFX942 = simulate("gfx942")


def _batch(q_lens, kv_lens, heads, kv_heads, dim, seed=0, **options):
    """The spec's own case maker with aiter's page size (a multiple of 128)."""
    make = spec._maker(q_lens, kv_lens, heads, kv_heads, dim, **{"block_size": 128, **options})
    return make(torch.device("cpu"), torch.Generator().manual_seed(seed))


def _check(kwargs):
    assert ask(adapter.supports, spec.SPEC, kwargs, GFX942) is None
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("kwargs", [
    _batch((1, 1, 1), (1, 200, 300), 8, 2, 128),                          # decode, GQA 4, partial pages
    _batch((3, 1, 9, 0, 5), (10, 130, 9, 6, 260), 6, 2, 64, seed=1),     # prefill, decode, a sequence without queries
    _batch((4, 7), (9, 7), 4, 4, 64, causal=False, seed=2),              # every query sees every key
    _batch((6, 1, 12), (200, 13, 12), 4, 1, 128, sliding_window=5, seed=3),
    _batch((3, 1, 1), (3, 9, 2), 2, 1, 64, sliding_window=1, seed=4),    # a window of self only
    _batch((1, 4, 1), (300, 260, 140), 4, 2, 64, table_slack=5, shared_prefix_blocks=1, seed=5),
    _batch((2, 1), (20, 150), 8, 8, 256, dtype=torch.float16, seed=6),  # fp16, head dim 256
    _batch((), (), 8, 2, 128),                                           # an empty batch
    _batch((0, 0), (5, 16), 4, 2, 64, seed=7),                           # sequences without queries
])
def test_adapter_matches_the_reference(gfx942, kwargs):
    _check(kwargs)
    calls = sys.modules["aiter.ops.mha"].CALLS
    assert len(calls) == (1 if kwargs["max_query_len"] else 0)
    if calls:
        window = kwargs["sliding_window"]
        assert calls[0]["window_size"] == ((window - 1, 0, 0) if window else (-1, -1, 0))
        assert calls[0]["causal"] == kwargs["causal"]


def test_cu_seqlens_k_is_the_running_sum_of_seq_lens():
    lengths = torch.tensor([5, 0, 17, 3], dtype=torch.int32)
    got = adapter.metadata({"seq_lens": lengths})
    assert got.dtype == torch.int32 and got.tolist() == [0, 5, 5, 22, 25]


@pytest.mark.parametrize("kwargs, reason", [
    (CASES["llama3_70b_tp8_decode_b8_ctx4096"].build(seed=1), "block_size a multiple of 128 only"),
    (_batch((1, 2), (5, 9), 4, 2, 64, cache_dtype=spec.FP8, scales=(0.5, 0.25)), "a cache of the query's dtype only"),
    (_batch((1, 40, 1), (300, 40, 77), 16, 8, 256, logits_soft_cap=30.0), "no logits soft cap"),
    (_batch((300, 64), (300, 1000), 8, 1, 64, with_sinks=True), "no sinks"),
    (_batch((1,), (9,), 4, 2, 20), "head dims that are multiples of 8 up to 256 only"),
])
def test_supports_declines_by_name(kwargs, reason):
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, GFX942)


def test_the_vendor_is_called_by_keyword(install_aiter):
    fake = sources("aiter")
    install_aiter(files={**fake, "aiter/ops/mha.py": reversed_signature(fake["aiter/ops/mha.py"],
                                                                        "flash_attn_varlen_func")})
    assert AITER.problem_for(CALLS["paged_attention"]) is None
    _check(_batch((3, 1), (130, 7), 4, 2, 64, seed=8))
