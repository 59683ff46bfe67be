"""The deepgemm backend's fused_moe against a fake deep_gemm that holds m_grouped_fp8_gemm_nt_contiguous's
shipped signature, host checks and contiguous-layout rules (tests/vendors/deep_gemm): the adapter's
results against the spec's reference (CONFIRMED patched open: on a real platform every call is declined
until a GPU run confirms it), its layout, declines, keyword calls, metadata and the vendor quarantine."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends.deepgemm import CALLS, DEEPGEMM
from kernelmux.backends.deepgemm import fused_moe as adapter
from kernelmux.conformance import _strided, poison_freed_memory
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.scaled_mm import quantize_weight_blocks
from vendors import install_fake, sources

CASES = {case.name: case for case in spec.SPEC.cases}
ALL = frozenset({"fp8_block"})
SM90 = simulate("sm_90")


def _install(monkeypatch, tmp_path, version="0.1.4.post1", files=None):
    return install_fake(monkeypatch, tmp_path, "deep_gemm", "sgl-deep-gemm", version, files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert DEEPGEMM.problem() is None
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    return sys.modules["deep_gemm"]


def _check(kwargs):
    expected = spec.SPEC.reference(**kwargs)
    actual = adapter.fused_moe(**kwargs)
    spec.SPEC.check_close(actual, expected, kwargs)
    return actual


def _hand_made(tokens=6, experts=4, topk=2, hidden=128, inter=128, seed=0, on_input=False, activation="silu"):
    """fp8_block experts quantized per 128 x 128 block, as a DeepSeek-V3 checkpoint holds them."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    values, ids = logits.topk(topk, dim=-1)
    weights = torch.rand(tokens, topk, generator=generator) + 0.5 if on_input else values.softmax(-1)
    w1 = (torch.rand(experts, 2 * inter, hidden, generator=generator) * 2 - 1) * (3.0 / hidden) ** 0.5
    w2 = (torch.rand(experts, hidden, inter, generator=generator) * 2 - 1) * (3.0 / inter) ** 0.5
    w1, w1_scale = (torch.stack(t) for t in zip(*(quantize_weight_blocks(m) for m in w1)))
    w2, w2_scale = (torch.stack(t) for t in zip(*(quantize_weight_blocks(m) for m in w2)))
    return dict(hidden=torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16), w1=w1, w2=w2,
                topk_weights=weights, topk_ids=ids.to(torch.int32), activation=activation, expert_map=None,
                apply_router_weight_on_input=on_input, quantization="fp8_block", w1_scale=w1_scale,
                w2_scale=w2_scale)


SERVED = ["small_fp8_block", "empty_fp8_block", "top1_weight_on_input_fp8_block"]


@pytest.mark.parametrize("name", SERVED + ["deepseek_v3_t16_fp8_block_ep256"])  # the model case: ~1 s
def test_adapter_matches_the_reference_on_the_spec_cases(vendor, name):
    kwargs = CASES[name].build(seed=1)
    assert ask(adapter.supports, spec.SPEC, kwargs, SM90) is None
    _check(kwargs)
    tokens = kwargs["hidden"].shape[0]
    calls = [c for c in vendor.CALLS if c.get("kind") == "m_grouped_contiguous"]
    assert len(calls) == (2 if tokens else 0)  # an empty batch never reaches the vendor
    if tokens:
        inter, hidden = kwargs["w1"].shape[1] // 2, kwargs["hidden"].shape[1]
        gate_up, down = calls
        assert (gate_up["n"], gate_up["k"], down["n"], down["k"]) == (2 * inter, hidden, hidden, inter)
        assert gate_up["compiled_dims"] == down["compiled_dims"] == "nk"
        # The scales reach the GEMMs already MN-major and TMA-aligned: no transpose inside.
        assert gate_up["sfa_was_ready"] and down["sfa_was_ready"]
        # Every local (token, expert) pair is one computed row: padding rows are never computed.
        ids = kwargs["topk_ids"] if kwargs["expert_map"] is None else kwargs["expert_map"][kwargs["topk_ids"].long()]
        pairs = int((ids >= 0).sum())
        assert gate_up["computed_rows"] == down["computed_rows"] == pairs


@pytest.mark.parametrize("name", SERVED)
def test_every_operand_strided_matches_the_reference(vendor, name):
    # The conformance kit's strided check on the fake: the adapter's own torch steps read views by their
    # strides and hand the vendor the layouts of a contiguous call (the real vendor: test_conformance.py).
    kwargs = CASES[name].build(seed=2)
    expected = spec.SPEC.reference(**kwargs)
    strided = {k: _strided(v) if isinstance(v, torch.Tensor) and v.dim() and v.numel() else v
               for k, v in kwargs.items()}
    spec.SPEC.check_close(adapter.fused_moe(**strided), expected, kwargs)


def test_every_spec_case_is_served_or_declined_by_name(vendor):
    for name, case in CASES.items():
        if "model" in case.tags:
            continue
        reason = ask(adapter.supports, spec.SPEC, case.build(), SM90)
        assert (reason is None) == (name in SERVED), (name, reason)


@pytest.mark.parametrize("tokens, topk, activation", [(1, 2, "silu"), (1, 1, "gelu"), (13, 3, "gelu"),
                                                      (40, 4, "silu")])
def test_hand_made_calls(vendor, tokens, topk, activation):
    # T = 1 (decode); 40 tokens x 4 of 4 experts: 40 rows per expert in one 128-row segment each.
    _check(_hand_made(tokens=tokens, topk=topk, activation=activation, seed=tokens))


def test_an_expert_parallel_rank_with_holes_in_the_map(vendor):
    # 12 global experts, this rank holds 3 at scattered global ids in shuffled local order.
    kwargs = _hand_made(tokens=9, experts=3, topk=3, seed=4)
    generator = torch.Generator().manual_seed(4)
    kwargs["topk_ids"] = torch.stack([torch.randperm(12, generator=generator)[:3] for _ in range(9)]).to(torch.int32)
    expert_map = torch.full((12,), -1, dtype=torch.int32)
    expert_map[torch.tensor([7, 2, 10])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    kwargs["expert_map"] = expert_map
    kwargs["topk_ids"][0] = torch.tensor([7, 2, 10], dtype=torch.int32)  # token 0: all three local
    kwargs["topk_ids"][1] = torch.tensor([0, 1, 3], dtype=torch.int32)  # token 1: none local -> zeros
    actual = _check(kwargs)
    assert torch.equal(actual[1], torch.zeros_like(actual[1]))
    assert actual[0].abs().sum() > 0


def test_no_pair_on_this_rank_gives_zeros(vendor):
    kwargs = _hand_made(tokens=3, experts=2, topk=2, seed=6)
    kwargs["expert_map"] = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    kwargs["topk_ids"] = torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    assert torch.equal(_check(kwargs), torch.zeros(3, 128, dtype=torch.bfloat16))


def test_the_router_weight_on_the_input(vendor):
    kwargs = _hand_made(tokens=5, topk=1, on_input=True, seed=9)
    kwargs["topk_weights"] = kwargs["topk_weights"] * 3.0  # far from 1: an unweighted call would be far off
    actual = _check(kwargs)
    unweighted = spec.SPEC.reference(**{**kwargs, "apply_router_weight_on_input": False})
    assert not torch.allclose(actual.float(), unweighted.float(), atol=1e-2)


def test_the_contiguous_layout(vendor):
    # Expert 1 gets 3 rows, expert 0 one, expert 2 none; off-rank slots (-1) get no row.
    ids = torch.tensor([[1, -1], [1, 0], [-1, 1]], dtype=torch.int32)
    layout = adapter.contiguous_layout(ids, 3, 128)
    assert layout.rows == 512  # the bound 6 slots + 3 experts * 127 = 387, up to 128: no host sync
    expected_m = torch.full((layout.rows,), -1, dtype=torch.int32)
    expected_m[0] = 0
    expected_m[128:131] = 1
    assert torch.equal(layout.m_indices, expected_m) and layout.m_indices.is_contiguous()
    assert layout.slot_rows.tolist() == [128, layout.rows, 129, 0, layout.rows, 130]
    assert layout.row_tokens[[0, 128, 129, 130]].tolist() == [1, 0, 1, 2]
    assert bool((layout.row_tokens[expected_m < 0] == 3).all())  # padding reads the zero token


def test_a_smaller_vendor_alignment_is_followed(vendor, monkeypatch):
    monkeypatch.setattr(vendor, "MK_ALIGNMENT", 64)
    _check(_hand_made(tokens=40, topk=2, seed=8))
    assert vendor.CALLS[-1]["m"] % 64 == 0


@pytest.mark.parametrize("changes, platform, reason", [
    ("small_fp8_block", "sm_100", "on sm_100 DeepGEMM takes UE8M0 scales only"),
    ("small_fp8_block", "sm_120", "run on sm_90 only, not sm_120"),
    ("small_fp8_block", "sm_89", "run on sm_90 only, not sm_89"),
    ("small_silu", "sm_90", "fp8_block only"),
    ("small_fp8_per_tensor", "sm_90", "got quantization 'fp8_per_tensor'"),
    ("small_fp8_block_fnuz_gelu", "sm_90", "float8_e4m3fn weights only"),
    ("fp8_block_h_i_not_multiple_of_128", "sm_90", "H and I multiples of 128 only"),
    ("fp8_block_below_one_block", "sm_90", "got H 72, I 40"),
])
def test_supports_declines_by_name(changes, platform, reason):
    # CONFIRMED as shipped: the not-confirmed decline comes after every other rule.
    assert reason in ask(adapter.supports, spec.SPEC, CASES[changes].build(), simulate(platform))


def test_shipped_confirmed_serves_fp8_block_on_sm90_and_an_unconfirmed_variant_is_declined(monkeypatch):
    # fp8_block confirmed on an H100 (tests-vendor, bench); emptied, the not-confirmed rule applies.
    for name in SERVED:
        assert ask(adapter.supports, spec.SPEC, CASES[name].build(), SM90) is None, name
    monkeypatch.setattr(adapter, "CONFIRMED", frozenset())
    assert ("fp8_block: not yet confirmed against the reference on a GPU (confirm with perf/run_gpu.sh "
            "tests-vendor)") in ask(adapter.supports, spec.SPEC, CASES["small_fp8_block"].build(), SM90)


def test_fp16_hidden_is_declined(monkeypatch):
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    kwargs = CASES["small_fp8_block"].build()
    kwargs["hidden"] = kwargs["hidden"].half()
    assert "bf16 hidden only" in ask(adapter.supports, spec.SPEC, kwargs, SM90)


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    # A release that reorders the parameters changes nothing: every argument is passed by name.
    fake = sources("deep_gemm")
    shipped = fake["deep_gemm/__init__.py"]
    reordered = shipped.replace(
        "def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None,",
        "def m_grouped_fp8_fp4_gemm_nt_contiguous(grouped_layout, d, b, a, recipe=None,").replace(
        "def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None,",
        "def transform_sf_into_required_layout(k, recipe, mn, sf, is_sfa=None, num_groups=None,")
    assert reordered.count("(grouped_layout, d, b, a, recipe=None,") == 1
    assert reordered.count("(k, recipe, mn, sf, is_sfa=None, num_groups=None,") == 1
    _install(monkeypatch, tmp_path, files={**fake, "deep_gemm/__init__.py": reordered})
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    assert DEEPGEMM.problem_for(CALLS["fused_moe"]) is None
    _check(CASES["small_fp8_block"].build(seed=5))


@pytest.mark.parametrize("old, new, reason", [
    ("def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout,",
     "def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices,",
     "deep_gemm.m_grouped_fp8_gemm_nt_contiguous takes no keyword grouped_layout"),
    ("recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False):",
     "recipe, is_sfa=None, disable_ue8m0_cast=False, num_groups=None, *, groups=None):",
     None),  # still takes num_groups: fine
    ("def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None,",
     "def transform_sf_into_required_layout(sf, mn, k, recipe, groups=None,",
     "deep_gemm.transform_sf_into_required_layout takes no keyword num_groups"),
    ("def get_mk_alignment_for_contiguous_layout():", "def get_mk_alignment_renamed():",
     "deep_gemm.get_mk_alignment_for_contiguous_layout: AttributeError"),
])
def test_a_missing_keyword_quarantines_the_vendor(monkeypatch, tmp_path, old, new, reason):
    fake = sources("deep_gemm")
    shipped = fake["deep_gemm/__init__.py"]
    changed = shipped.replace(old, new)
    if old.startswith("def get_mk"):
        changed = changed.replace("get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout",
                                  "get_m_alignment_for_contiguous_layout = get_mk_alignment_renamed").replace(
            "get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout", "")
    assert changed != shipped
    _install(monkeypatch, tmp_path, files={**fake, "deep_gemm/__init__.py": changed})
    problem = DEEPGEMM.problem_for(CALLS["fused_moe"])
    if reason is None:
        assert problem is None
        return
    assert reason in problem
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    rejected = {impl.backend: why for impl, why in engine.tables["fused_moe"].rejected}
    assert reason in rejected["deepgemm"]


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables["fused_moe"].candidates if c.impl.backend == "deepgemm"]
    assert impl.description.startswith("sgl-deep-gemm 0.1.4.post1: m_grouped_fp8_gemm_nt_contiguous")
    assert impl.supports is adapter.supports and impl.fn is adapter.fused_moe
    on_cpu = {impl.backend: why for impl, why in Engine(ALL_SPECS, Settings(platform="x86_64"))
              .tables["fused_moe"].rejected}
    assert "needs a cuda platform" in on_cpu["deepgemm"]


def test_metadata_is_the_weight_scale_conversion(vendor):
    kwargs = CASES["small_fp8_block"].build(seed=2)
    scales = adapter.metadata(kwargs)
    assert torch.equal(scales.w1, kwargs["w1_scale"]) and torch.equal(scales.w2, kwargs["w2_scale"])
    assert scales.w1.is_contiguous() and scales.w2.is_contiguous()
    # A transposed-contiguous copy is made contiguous before DeepGEMM's sm90_sfb_check sees it.
    strided = kwargs["w1_scale"].transpose(0, 2).contiguous().transpose(0, 2)
    assert torch.equal(adapter.metadata({**kwargs, "w1_scale": strided}).w1, kwargs["w1_scale"])
    assert adapter.metadata({**kwargs, "hidden": kwargs["hidden"][:0]}) is None


def test_an_experts_rows_never_share_a_block_with_another_expert(vendor, monkeypatch):
    # The fake computes a whole M block with the expert of its first row, as the kernel does: a layout
    # without alignment (each expert's rows packed right after the last one's) is caught by the reference.
    real = adapter.contiguous_layout
    monkeypatch.setattr(adapter, "contiguous_layout", lambda ids, experts, alignment: real(ids, experts, 1))
    kwargs = _hand_made(tokens=8, topk=2, seed=10)
    with pytest.raises(AssertionError):
        spec.SPEC.check_close(adapter.fused_moe(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


_REAL = importlib.util.find_spec("deep_gemm") is not None
_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
@pytest.mark.parametrize("name", SERVED + ["deepseek_v3_t16_fp8_block_ep256"])
def test_real_deepgemm_matches_the_reference_on_sm90(monkeypatch, name):
    assert DEEPGEMM.problem_for(CALLS["fused_moe"]) is None, DEEPGEMM.problem_for(CALLS["fused_moe"])
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    kwargs = CASES[name].build(device=torch.device("cuda"), seed=11)
    spec.SPEC.check_close(adapter.fused_moe(**kwargs), spec.SPEC.reference(**kwargs), kwargs)


_STRIDABLE = ("hidden", "w1", "w2", "topk_weights", "topk_ids", "w1_scale", "w2_scale")


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
@pytest.mark.parametrize("strided", [(name,) for name in _STRIDABLE] + [_STRIDABLE])
def test_real_deepgemm_reads_strided_inputs(monkeypatch, strided):
    # The kit's strided check gave NaN rows on an H200: a strided w1_scale or w2_scale reached DeepGEMM
    # as a temporary copy, and its untransformed result did not hold that copy's memory (transform_scales).
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    kwargs = CASES["small_fp8_block"].build(device=torch.device("cuda"), seed=12)
    views = {k: _strided(v) if k in strided else v for k, v in kwargs.items()}
    spec.SPEC.check_close(adapter.fused_moe(**views), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
def test_real_deepgemm_reads_nothing_past_fresh_weight_buffers(monkeypatch):
    # Weights and scales copied just after NaN-filled blocks were freed (the strided run's allocations,
    # without a stride): a read past any of their ends would put NaN in the output.
    monkeypatch.setattr(adapter, "CONFIRMED", ALL)
    kwargs = CASES["small_fp8_block"].build(device=torch.device("cuda"), seed=13)
    poison_freed_memory("cuda", 1 << 26)
    fresh = {k: v.clone() if k in ("w1", "w2", "w1_scale", "w2_scale") else v for k, v in kwargs.items()}
    spec.SPEC.check_close(adapter.fused_moe(**fresh), spec.SPEC.reference(**kwargs), kwargs)


@pytest.mark.skipif(not (_REAL and _H100), reason="needs an sm_90 GPU (H100/H200) with sgl-deep-gemm installed")
def test_real_deepgemm_captures_in_a_cuda_graph_and_replays_new_inputs():
    # A host copy inside the routing (padded[E] = 0 from a CPU scalar) once broke capture: the
    # bench fell back to per-call events and a serving engine's decode graph could not hold the op.
    kwargs = CASES["deepseek_v3_t16_fp8_block_ep256"].build(device=torch.device("cuda"), seed=3)
    adapter.fused_moe(**kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = adapter.fused_moe(**kwargs)
    fresh = CASES["deepseek_v3_t16_fp8_block_ep256"].build(device=torch.device("cuda"), seed=4)
    for name in ("hidden", "topk_weights", "topk_ids"):
        kwargs[name].copy_(fresh[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    spec.SPEC.check_close(out, spec.SPEC.reference(**kwargs), kwargs)
