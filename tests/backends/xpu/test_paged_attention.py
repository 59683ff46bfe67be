"""The xpu backend's paged_attention against the fake vllm-xpu-kernels (flash_attn_varlen_func with the shipped
signature over a varlen_fwd that checks flash_api.cpp's rules and models which kernel takes which
sequence): results against the spec's reference, the routing around the decode kernel's one-row-per-
sequence rule, fp8 descales, declines and keyword calls."""

from __future__ import annotations

import pytest
import torch

from fakes import ask
from kernelmux.backends.xpu import paged_attention as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import paged_attention as spec
from vendors import sources

XPU = simulate("xpu")
FP8 = torch.float8_e4m3fn
# The spec's quick cases the adapter takes (head dims 64/128 and 16-row blocks); gemma2_soft_cap and the
# small cases with head dims below 64 are declined (test_supports_declines_by_name).
CASES = ("llama3_70b_tp8_decode_b8_ctx4096", "llama3_8b_prefill_t1024_4seqs", "llama3_8b_chunked_prefill",
         "gpt_oss_120b_tp8_window_sinks_decode", "gpt_oss_120b_tp8_sinks_prefill", "small_gqa_decode_fp16",
         "empty_batch", "no_queries")


def _batch(q_lens, kv_lens, heads=4, kv_heads=2, head_dim=64, seed=0, **options):
    return spec._maker(tuple(q_lens), tuple(kv_lens), heads, kv_heads, head_dim, **options)(
        torch.device("cpu"), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_spec_cases_match_the_reference(vendor, case):
    kwargs = spec.SPEC.case(case).build(seed=3)
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("q_lens, kv_lens, options, route", [
    ((1, 1, 1), (40, 17, 90), dict(block_size=32), "decode"),
    ((1, 1), (64, 200), dict(block_size=64, cache_dtype=FP8, scales=(0.3, 0.07)), "decode"),
    ((1, 1), (20, 33), dict(cache_dtype=FP8, dtype=torch.float16, scale=0.05), "decode"),  # fp8 without scales
    ((5, 1, 12, 0, 3), (9, 30, 12, 6, 70), dict(), "prefill"),       # mixed, one sequence without a query
    ((1, 1, 0), (5, 9, 7), dict(), "prefill"),                       # a decode batch with an empty sequence
    ((4, 4, 4), (40, 10, 4), dict(sliding_window=6), "prefill"),     # uniform small (the vendor's MTP route)
    ((6, 1, 12), (20, 13, 12), dict(sliding_window=5, head_dim=128), "prefill"),
    ((1, 1, 1), (20, 300, 3), dict(sliding_window=8, with_sinks=True), "decode"),
    ((4, 7), (9, 7), dict(causal=False), "prefill"),
    ((3, 1), (19, 6), dict(cache_dtype=FP8, scales=(0.3, 0.07), with_sinks=True), "prefill"),
])
def test_adapter_matches_the_reference(vendor, q_lens, kv_lens, options, route):
    head_dim = options.pop("head_dim", 64)
    kwargs = _batch(q_lens, kv_lens, head_dim=head_dim, seed=len(q_lens), **options)
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
    [call] = vendor["_vllm_fa2_C"].CALLS
    assert (call["max_seqlen_q"], call["mix_batch"]) == ((1, True) if route == "decode" else
                                                          (max(max(q_lens), 2), False))
    assert call["fp8"] == (kwargs["k_cache"].dtype == FP8)
    assert vendor["flash_attn_interface"].COPIES == []


def test_views_of_a_joint_cache_are_read_in_place(vendor):
    # vLLM's [num_blocks, 2, block_size, Hkv, D] cache: K and V are views with the same strides.
    kwargs = _batch((2, 1), (40, 70), seed=9)
    joint = torch.stack((kwargs["k_cache"], kwargs["v_cache"]), dim=1)
    kwargs["k_cache"], kwargs["v_cache"] = joint[:, 0], joint[:, 1]
    assert ask(adapter.supports, spec.SPEC, kwargs, XPU) is None
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


def test_a_sequence_without_a_query_in_the_decode_kernel_is_written_elsewhere(vendor):
    # Why such batches go to the chunk-prefill kernel: the decode kernel takes one row per sequence.
    from vllm_xpu_kernels import flash_attn_varlen_func

    kwargs = _batch((1, 1, 0), (5, 9, 7), seed=1)
    with pytest.raises(RuntimeError, match="out of bounds"):
        flash_attn_varlen_func(q=kwargs["query"], k=kwargs["k_cache"], v=kwargs["v_cache"], max_seqlen_q=1,
                               cu_seqlens_q=kwargs["cu_seqlens_q"], max_seqlen_k=9, seqused_k=kwargs["seq_lens"],
                               causal=True, block_table=kwargs["block_table"])


def test_the_soft_cap_would_be_ignored(vendor):
    # Why soft-capped calls are declined: varlen_fwd takes softcap and applies it nowhere.
    from vllm_xpu_kernels import flash_attn_varlen_func

    kwargs = _batch((3, 1), (30, 20), seed=2, logits_soft_cap=2.0, scale=1.0)
    got = flash_attn_varlen_func(q=kwargs["query"], k=kwargs["k_cache"], v=kwargs["v_cache"], max_seqlen_q=3,
                                 cu_seqlens_q=kwargs["cu_seqlens_q"], max_seqlen_k=30, seqused_k=kwargs["seq_lens"],
                                 softmax_scale=1.0, causal=True, softcap=2.0, block_table=kwargs["block_table"],
                                 is_mix_batch=False)
    with pytest.raises(AssertionError):
        spec.SPEC.check_close(got, spec.SPEC.reference(**kwargs), kwargs)


def test_descales_are_views_of_one_fp32_element():
    cache = torch.zeros(4, 16, 2, 64, dtype=FP8)
    scales = adapter.descales(cache, torch.tensor([0.5, 9.0])[:1], None, num_seqs=3)
    assert scales.k.shape == (3, 2) and scales.k.untyped_storage().nbytes() == 4 and float(scales.k[2, 1]) == 0.5
    assert float(scales.v[0, 0]) == 1.0  # None is 1.0: the kernels dereference both
    assert adapter.descales(torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), None, None, 3) == (None, None)


@pytest.mark.parametrize("changes, reason", [
    (dict(head_dim=32), "head dims [64, 96, 128, 192, 256, 512] only"),
    (dict(block_size=8), "block sizes that are multiples of 16 only"),
    (dict(logits_soft_cap=30.0), "no logits soft cap"),
    (dict(with_sinks=True, dtype=torch.float16), "sinks with bf16 queries only"),
])
def test_supports_declines_by_name(changes, reason):
    kwargs = _batch((2, 1), (20, 9), **{"head_dim": 64, **changes})
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, XPU)


def test_caches_the_kernels_cannot_address_are_declined():
    kwargs = _batch((2, 1), (20, 9), seed=4)
    wide = torch.zeros(*kwargs["k_cache"].shape[:3], 128, dtype=torch.bfloat16)
    assert "k_cache needs a unit stride" in ask(adapter.supports, spec.SPEC, {
        **kwargs, "k_cache": wide[..., ::2], "v_cache": wide[..., 1::2]}, XPU)
    blocks, block_size, kv_heads, head_dim = kwargs["k_cache"].shape
    padded = torch.zeros(blocks, block_size + 1, kv_heads, head_dim, dtype=torch.bfloat16)[:, :block_size]
    assert "the same strides only" in ask(adapter.supports, spec.SPEC, {**kwargs, "v_cache": padded}, XPU)


def test_the_wrapper_is_called_by_keyword(install_xpu):
    # Its parameters reordered (within the required and the defaulted runs), a keyword call still works.
    fake = sources("vllm_xpu_kernels")
    shipped = fake["vllm_xpu_kernels/flash_attn_interface.py"]
    head, rest = shipped.split("def flash_attn_varlen_func(\n", 1)
    parameters, body = rest.split("\n):\n", 1)
    lines = parameters.split("\n")
    required = [line for line in lines if "=" not in line]
    defaulted = [line for line in lines if "=" in line]
    reordered = head + "def flash_attn_varlen_func(\n" + "\n".join(required[::-1] + defaulted[::-1]) + "\n):\n" + body
    install_xpu(files={**fake, "vllm_xpu_kernels/flash_attn_interface.py": reordered})
    kwargs = _batch((3, 1), (30, 20), seed=5, cache_dtype=FP8, scales=(0.2, 0.4))
    spec.SPEC.check_close(adapter.paged_attention(**kwargs), spec.SPEC.reference(**kwargs), kwargs)
