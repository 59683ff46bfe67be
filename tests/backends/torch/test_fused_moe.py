"""The torch backend's fused_moe: every decline by name, the static check, registration through
the entry point; on the CPU (torch's CPU grouped_mm runs the same code) every unquantized named
case, strided inputs and expert maps against the spec's reference; on an sm_90 GPU the same with
NaN-poisoned memory, odd shapes and a CUDA-graph replay with new routing."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from fakes import ask
from kernelmux.backends.torch import _torch_api
from kernelmux.backends.torch import fused_moe as impl
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import fused_moe as spec

HOPPER = simulate("sm_90")
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU: runs in the GPU suite (perf/run_gpu.sh)")
# The quantized cases say so in their names (building them all to read `quantization` takes seconds).
UNQUANTIZED = [c.name for c in spec.SPEC.cases if "fp8" not in c.name and "fp4" not in c.name]


def _build(make, seed: int = 0, device: str = "cpu") -> dict:
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _check(kwargs: dict, seed: int = 0) -> None:
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    expected = spec.SPEC.reference(**ref_kwargs)
    actual = impl.fused_moe(**kwargs)
    try:
        spec.SPEC.check_close(actual, expected, ref_kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


# ---------------------------------------------------------------------------------------------
# What it declines, and why (any machine)

def _misaligned_w1(kwargs: dict) -> dict:
    w1 = kwargs["w1"]
    flat = torch.zeros(w1.numel() + 1, dtype=w1.dtype)
    flat[1:] = w1.reshape(-1)
    return dict(kwargs, w1=flat[1:].view(w1.shape))


@pytest.mark.parametrize("make, change, reason", [
    (spec._maker(6, 8, 2, 96, 64, quantization="fp8_per_tensor"), None, "unquantized weights only"),
    (spec._maker(6, 6, 2, 256, 128, quantization="fp8_block"), None, "unquantized weights only"),
    (spec._maker(6, 6, 2, 64, 64, quantization="mxfp4"), None, "unquantized weights only"),
    (spec._maker(5, 6, 3, 64, 32, dtype=torch.float16), None, "bf16 only, got torch.float16"),
    (spec._maker(5, 6, 2, 60, 32), None, "H and I multiples of 8 only"),
    (spec._maker(5, 6, 2, 64, 36), None, "H and I multiples of 8 only"),
    (spec._maker(5, 6, 2, 64, 32), _misaligned_w1, "w1 needs a unit stride along its rows and 16-byte aligned"),
    (spec._maker(5, 6, 2, 64, 32), lambda kw: dict(kw, w2=kw["w2"].transpose(1, 2).contiguous().transpose(1, 2)),
     "w2 needs a unit stride"),
], ids=["fp8_per_tensor", "fp8_block", "mxfp4", "fp16", "h_60", "i_36", "w1_misaligned", "w2_column_major"])
def test_declines_by_name(make, change, reason):
    kwargs = _build(make)
    if change is not None:
        kwargs = change(kwargs)
    answer = ask(impl.supports, spec.SPEC, kwargs, HOPPER)
    assert answer is not None and reason in answer, answer


def test_takes_every_bf16_named_case():
    for name in UNQUANTIZED:
        kwargs = spec.SPEC.case(name).build("cpu", 0)
        if kwargs["hidden"].dtype == torch.bfloat16:
            assert ask(impl.supports, spec.SPEC, kwargs, HOPPER) is None, name


@pytest.mark.parametrize("arch, reason", [
    ("sm_90", None), ("sm_100", None), ("sm_120", "on sm_120 it loops over experts"),
])
def test_static_check_by_arch(arch, reason):
    answer = _torch_api.grouped_mm_problem(simulate(arch))
    assert answer is None if reason is None else reason in answer


def test_static_check_declines_an_old_torch_or_one_without_grouped_mm(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    assert "torch 2.8.0 is older than 2.10" in _torch_api.grouped_mm_problem(HOPPER)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.delattr(torch, "_grouped_mm")
    assert "has no torch._grouped_mm" in _torch_api.grouped_mm_problem(HOPPER)


def test_registered_through_the_entry_point():
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    torch_impl = next(c.impl for c in engine.tables["fused_moe"].candidates if c.impl.backend == "torch")
    assert torch_impl.fn is impl.fused_moe and torch_impl.supports is impl.supports
    assert torch_impl.devices == frozenset({"cuda"})
    for platform, reason in (("sm_89", "needs capability >= 9.0"), ("sm_120", "sm_90/sm_100 only")):
        rejected = dict((i.backend, r) for i, r in Engine(ALL_SPECS, Settings(platform=platform)).tables["fused_moe"].rejected)
        assert reason in rejected["torch"], rejected


# ---------------------------------------------------------------------------------------------
# On the CPU: torch's CPU grouped_mm (a loop over groups) runs the implementation's own code; the
# registered implementation serves CUDA only, where grouped_mm is one CUTLASS kernel.

@pytest.mark.parametrize("name", UNQUANTIZED)
def test_named_cases_on_cpu(name):
    kwargs = spec.SPEC.case(name).build("cpu", 7)
    _check(kwargs, 7)


def test_strided_routing_and_hidden_on_cpu():
    kwargs = _build(spec._maker(9, 12, 3, 64, 32, unmapped=5), 4)
    wide = torch.zeros(kwargs["hidden"].shape[0], 96, dtype=torch.bfloat16)
    wide[:, 8:72] = kwargs["hidden"]
    ids_t = kwargs["topk_ids"].t().contiguous().t()
    weights = torch.zeros(kwargs["topk_weights"].shape[0], 6)
    weights[:, ::2] = kwargs["topk_weights"]
    strided = dict(kwargs, hidden=wide[:, 8:72], topk_ids=ids_t, topk_weights=weights[:, ::2])
    assert not strided["hidden"].is_contiguous() and not strided["topk_weights"].is_contiguous()
    assert ask(impl.supports, spec.SPEC, strided, HOPPER) is None
    _check(strided, 4)


def test_every_pair_off_rank_gives_zeros_on_cpu():
    kwargs = _build(spec._maker(5, 8, 2, 64, 32, local_experts=2), 3)
    kwargs["expert_map"] = torch.full_like(kwargs["expert_map"], -1)
    out = impl.fused_moe(**kwargs)
    assert out.shape == (5, 64) and bool((out == 0).all())


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU

def _poison(nbytes: int) -> None:
    blocks = [torch.full((nbytes // 4 + extra,), float("nan"), device="cuda") for extra in (0, 64, 4096)]
    del blocks


def _gpu_check(kwargs: dict, seed: int) -> None:
    assert ask(impl.supports, spec.SPEC, kwargs) is None
    topk = kwargs["topk_ids"].shape[1]
    _poison(kwargs["hidden"].numel() * topk * 4 * 4 + kwargs["w1"][0].numel() * topk * 8)
    _check(kwargs, seed)


@needs_sm90
@pytest.mark.parametrize("name", [c.name for c in spec.SPEC.cases])
def test_named_cases_on_sm90(name):
    kwargs = spec.SPEC.case(name).build("cuda", 13)
    reason = ask(impl.supports, spec.SPEC, kwargs)
    if reason is not None:
        pytest.skip(f"declined: {reason}")
    _gpu_check(kwargs, 13)


# T 1, 3, 33 and 257 tokens; E with experts no token picks; I and H multiples of 8 but not of 64.
@needs_sm90
@pytest.mark.parametrize("tokens", [1, 3, 33, 257])
@pytest.mark.parametrize("experts, topk, hidden_size, inter_size, extra", [
    (8, 2, 64, 48, {}),
    (16, 4, 136, 72, {"activation": "gelu"}),
    (64, 8, 512, 256, {"local_experts": 16}),
    (12, 3, 128, 64, {"unmapped": 7}),
    (8, 1, 256, 128, {"on_input": True}),
], ids=["small", "gelu_h136_i72", "ep_slice", "map_holes", "weight_on_input"])
def test_odd_shapes_on_sm90(tokens, experts, topk, hidden_size, inter_size, extra):
    seed = tokens * 31 + experts
    _gpu_check(_build(spec._maker(tokens, experts, topk, hidden_size, inter_size, **extra), seed, "cuda"), seed)


@needs_sm90
def test_strided_inputs_on_sm90():
    kwargs = _build(spec._maker(17, 16, 4, 256, 128, unmapped=3), 8, "cuda")
    wide = torch.zeros(17, 320, dtype=torch.bfloat16, device="cuda")
    wide[:, 16:272] = kwargs["hidden"]
    kwargs = dict(kwargs, hidden=wide[:, 16:272], topk_ids=kwargs["topk_ids"].t().contiguous().t())
    _gpu_check(kwargs, 8)


@needs_sm90
def test_empty_batch_on_sm90():
    out = impl.fused_moe(**_build(spec._maker(0, 8, 2, 64, 32), 0, "cuda"))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@needs_sm90
@pytest.mark.parametrize("extra", [{}, {"local_experts": 8}], ids=["all_local", "expert_map"])
def test_graph_replays_new_routing_on_sm90(extra):
    # Captured once, replayed with new tokens, routing and weights: nothing read on the host, so
    # the replay follows the new routing (a host-read count would stay the capture's).
    make = spec._maker(48, 32, 4, 256, 128, **extra)
    static = _build(make, 0, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            impl.fused_moe(**static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = impl.fused_moe(**static)
    for seed in (1, 2):
        fresh = _build(make, seed, "cuda")
        for name in ("hidden", "topk_weights", "topk_ids"):
            static[name].copy_(fresh[name])
        result.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        spec.SPEC.check_close(result, spec.SPEC.reference(**static), static)
