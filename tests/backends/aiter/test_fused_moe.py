"""The aiter backend's fused_moe against the fake aiter (tests/vendors/aiter/fused_moe.py): results
against the spec's reference on gfx942 (e4m3fnuz) and gfx950 (e4m3fn), the expert map as a mask, the
per-call weight shuffle, declines by name and keyword calls."""

from __future__ import annotations

import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import AITER, CALLS
from kernelmux.backends.aiter import fused_moe as adapter
from kernelmux.platforms import simulate
from kernelmux.specs import fused_moe as spec
from vendors import reversed_signature, sources

CASES = {case.name: case for case in spec.SPEC.cases}
FNUZ, FN = simulate("gfx942"), simulate("gfx950")


def _calls():
    return sys.modules["aiter.fused_moe"].CALLS


def _check(kwargs, platform):
    assert ask(adapter.supports, spec.SPEC, kwargs, platform) is None
    spec.SPEC.check_close(adapter.fused_moe(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.parametrize("name, platform", [
    ("small_fp8_block", FN),                      # two 1x128 groups, 2 x 2 w1 blocks
    ("small_fp8_block_fnuz_gelu", FNUZ),          # e4m3fnuz (max 240) on gfx942, erf GELU
    ("top1_weight_on_input_fp8_block", FN),       # the router weight scales x before its quantization
    ("empty_fp8_block", FN),                      # T = 0 never reaches the vendor
    ("qwen3_30b_a3b_t16_ep16", FNUZ),             # 8 of 128 experts local: the map becomes a mask
])
def test_the_spec_cases_it_accepts_match_the_reference(install_aiter, name, platform):
    install_aiter(platform.arch)
    kwargs = CASES[name].build(seed=3)
    _check(kwargs, platform)
    assert len(_calls()) == (1 if kwargs["hidden"].shape[0] else 0)


@pytest.mark.parametrize("name, reason", [
    ("small_silu", "H and I multiples of 128 only"),
    ("small_fp8_per_tensor", "fp8_per_tensor declined"),
    ("fp8_block_h_i_not_multiple_of_128", "got H = 200, I = 100"),
    ("small_fp8_block_fnuz_gelu", "e4m3fn weights only on gfx950"),
])
def test_the_spec_cases_it_declines_say_why(name, reason):
    assert reason in ask(adapter.supports, spec.SPEC, CASES[name].build(seed=1), FN)


def _drawn(tokens=7, experts=6, topk=2, hidden=256, inter=128, *, dtype=torch.bfloat16, seed=0, unmapped=0,
           on_input=False, activation="silu", strided=False):
    """bf16/fp16 experts at magnitudes of a trained layer, routing as a router returns it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden * (2 if strided else 1), generator=generator).to(dtype)
    logits = torch.randn(tokens, experts + unmapped, generator=generator)
    values, ids = logits.topk(topk, dim=-1)
    local = experts
    expert_map = None
    if unmapped:
        # Local ids in a shuffled order and `unmapped` experts of other ranks (-1).
        perm = torch.randperm(experts + unmapped, generator=generator)
        expert_map = torch.full((experts + unmapped,), -1, dtype=torch.int32)
        expert_map[perm[:experts]] = torch.arange(experts, dtype=torch.int32)
    weights = torch.rand(tokens, topk, generator=generator) + 0.5 if on_input else values.softmax(-1)
    return dict(
        hidden=x[:, ::2] if strided else x,
        w1=((torch.rand(local, 2 * inter, hidden, generator=generator) * 2 - 1) * (3 / hidden) ** 0.5).to(dtype),
        w2=((torch.rand(local, hidden, inter, generator=generator) * 2 - 1) * (3 / inter) ** 0.5).to(dtype),
        topk_weights=weights, topk_ids=ids.to(torch.int32), activation=activation, expert_map=expert_map,
        apply_router_weight_on_input=on_input, quantization="none", w1_scale=None, w2_scale=None,
    )


@pytest.mark.parametrize("kwargs", [
    _drawn(),
    _drawn(dtype=torch.float16, activation="gelu", seed=1),
    _drawn(tokens=1, seed=2),                               # one decode token
    _drawn(tokens=9, topk=3, unmapped=5, seed=3),           # a map with holes, local ids shuffled
    _drawn(tokens=5, topk=1, on_input=True, seed=4),        # Llama-4: the weight scales the input
    _drawn(tokens=5, strided=True, seed=5),                 # every other column of a wider hidden
])
def test_drawn_bf16_and_fp16_experts_match_the_reference(gfx942, kwargs):
    _check(kwargs, FNUZ)
    [call] = _calls()
    assert call["mask"] == (kwargs["expert_map"] is not None) and not call["doweight_stage1"]


def test_prepare_shuffles_with_aiters_own_function_and_numbers_the_map_as_a_mask(gfx942):
    kwargs = _drawn(tokens=9, topk=3, unmapped=5, seed=3)
    prepared = adapter.metadata(kwargs)
    assert prepared.w1.is_shuffled and prepared.w2.is_shuffled
    assert not torch.equal(prepared.w1, kwargs["w1"])  # the (16, 16) layout, not the row-major one
    experts = kwargs["w1"].shape[0]
    assert prepared.expert_mask.tolist() == [1] * experts + [0]
    local = kwargs["expert_map"].long()[kwargs["topk_ids"].long()]
    assert torch.equal(prepared.topk_ids.long(), torch.where(local >= 0, local, experts))


@pytest.mark.parametrize("changes, platform, reason", [
    (dict(quantization="fp8_per_tensor"), FN, "fp8_per_tensor declined"),
    (dict(hidden=torch.randn(4, 200).bfloat16()), FN, "got H = 200"),
])
def test_supports_declines_by_name(changes, platform, reason):
    kwargs = _drawn(tokens=4)
    if "quantization" in changes:
        kwargs = CASES["small_fp8_per_tensor"].build(seed=1)
    else:
        kwargs.update(changes, w1=kwargs["w1"][:, :, :1].expand(-1, -1, 200).contiguous(),
                      w2=kwargs["w2"][:, :1].expand(-1, 200, -1).contiguous())
    assert reason in ask(adapter.supports, spec.SPEC, kwargs, platform)


def test_fp8_block_needs_bf16_hidden():
    kwargs = CASES["small_fp8_block"].build(seed=1)
    kwargs["hidden"] = kwargs["hidden"].half()
    assert "bf16 hidden only with fp8 block weights" in ask(adapter.supports, spec.SPEC, kwargs, FN)


def test_the_vendor_is_called_by_keyword(install_aiter):
    fake = sources("aiter")
    install_aiter(files={**fake, "aiter/fused_moe.py": reversed_signature(fake["aiter/fused_moe.py"], "fused_moe")})
    assert AITER.problem_for(CALLS["fused_moe"]) is None
    _check(_drawn(tokens=3, seed=7), FNUZ)
