"""The torch backend's scaled_mm: every decline by name on simulated platforms, the static check of
the installed torch, registration through the entry point; on the CPU, the per-tensor and
per-channel plumbing (scale layouts, bias, strided operands) through torch's CPU scaled mm; on an
sm_90 GPU, every scale layout against the spec's reference with fresh inputs, NaN-poisoned
output memory, strided views, empty and odd shapes, and a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from fakes import ask
from kernelmux.backends.torch import _torch_api
from kernelmux.backends.torch import scaled_mm as impl
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import scaled_mm as spec

HOPPER = simulate("sm_90")
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU: runs in the GPU suite (perf/run_gpu.sh)")


def _build(make, seed: int = 0, device: str = "cpu") -> dict:
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _check(kwargs: dict, seed: int = 0) -> None:
    expected = spec.SPEC.reference(**kwargs)
    actual = impl.scaled_mm(**kwargs)
    try:
        spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


# ---------------------------------------------------------------------------------------------
# What it declines, and why (any machine)

@pytest.mark.parametrize("make, platform, reason", [
    (spec._maker(5, 256, 256, "block", fp8_dtype="e4m3fnuz"), "sm_90", "float8_e4m3fn operands only"),
    (spec._maker(7, 24, 64, "tensor"), "sm_90", "K and N multiples of 16 only"),  # N 24
    (spec._maker(6, 256, 200, "block"), "sm_90", "K and N multiples of 16 only"),  # K 200
    (spec._maker(4, 256, 256, "block"), "sm_89", "block scales on sm_90 only"),
    (spec._maker(4, 256, 256, "block"), "sm_100", "block scales on sm_90 only"),
    # K 144: a multiple of 16 whose last K group holds 16 elements.
    (spec._maker(4, 256, 144, "block"), "sm_90", "K a multiple of 128 only"),
    (spec._maker(4, 64, 64, "channel", out_dtype="float16"), "sm_89", "with float16 output on sm_90 only"),
    (spec._maker(4, 64, 64, "channel", out_dtype="float32"), "sm_100", "bf16 or fp16 output only"),
    # fp32 outputs were up to 9 x 2^-14 sum_k |a||b| off on the H100 (test_odd_shapes_on_sm90 at 220d0ef).
    (spec._maker(4, 64, 64, "tensor", out_dtype="float32", with_bias=True), "sm_90", "bf16 or fp16 output only"),
    (spec._maker(4, 256, 256, "block", out_dtype="float32"), "sm_90", "bf16 or fp16 output only"),
], ids=["fnuz", "n_24", "k_200", "block_sm89", "block_sm100", "block_k_144", "rowwise_fp16_sm89",
        "rowwise_fp32_sm100", "tensor_fp32_sm90", "block_fp32_sm90"])
def test_declines_by_name(make, platform, reason):
    answer = ask(impl.supports, spec.SPEC, _build(make), simulate(platform))
    assert answer is not None and reason in answer, answer


@pytest.mark.parametrize("make, platform", [
    (spec._maker(4, 64, 64, "channel", out_dtype="float16", with_bias=True), "sm_90"),
    (spec._maker(4, 64, 64, "channel", out_dtype="bfloat16", with_bias=True), "sm_89"),
    (spec._maker(4, 64, 64, "tensor", out_dtype="float16", with_bias=True), "sm_100"),
    (spec._maker(4, 208, 384, "block", with_bias=True), "sm_90"),  # N 208: a short last N block
    (spec._maker(1, 256, 128, "block", out_dtype="float16"), "sm_90"),
], ids=["rowwise_fp16_sm90", "rowwise_bf16_sm89", "tensor_fp16_sm100", "block_n_208", "block_fp16"])
def test_takes(make, platform):
    assert ask(impl.supports, spec.SPEC, _build(make), simulate(platform)) is None


def test_takes_every_named_model_case_on_sm90():
    for case in spec.SPEC.cases:
        if "model" in case.tags:
            assert ask(impl.supports, spec.SPEC, case.build("cpu", 0), HOPPER) is None, case.name


def test_v1_api_declines_unpadded_block_scales(monkeypatch):
    # torch._scaled_mm takes the 128x128 scales as [Nb, Kb] exactly: Kb = 2 would be read as 4.
    kwargs = _build(spec._maker(4, 256, 256, "block"))
    monkeypatch.setattr(impl, "scaled_mm_api", lambda: _torch_api.V1)
    assert "ceil(K/128) a multiple of 4" in ask(impl.supports, spec.SPEC, kwargs, HOPPER)
    assert ask(impl.supports, spec.SPEC, _build(spec._maker(4, 256, 512, "block")), HOPPER) is None
    monkeypatch.setattr(impl, "scaled_mm_api", lambda: _torch_api.V2)
    assert ask(impl.supports, spec.SPEC, kwargs, HOPPER) is None


# ---------------------------------------------------------------------------------------------
# The static check of the installed torch, and registration

def test_static_check_takes_this_torch():
    assert _torch_api.scaled_mm_problem(HOPPER) is None
    assert _torch_api.scaled_mm_api() == _torch_api.V2  # torch >= 2.10 has the public API


def test_static_check_declines_an_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    assert "torch 2.9.1+cu128 is older than 2.10" in _torch_api.scaled_mm_problem(HOPPER)


def test_static_check_falls_back_to_the_private_api_then_declines(monkeypatch):
    _torch_api.scaled_mm_api.cache_clear()
    try:
        monkeypatch.delattr(torch.nn.functional, "scaled_mm")
        assert _torch_api.scaled_mm_api() == _torch_api.V1
        _torch_api.scaled_mm_api.cache_clear()
        monkeypatch.delattr(torch, "_scaled_mm")
        assert "has neither" in _torch_api.scaled_mm_problem(HOPPER)
    finally:
        monkeypatch.undo()
        _torch_api.scaled_mm_api.cache_clear()


def test_registered_through_the_entry_point():
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    candidates = [c.impl for c in engine.tables["scaled_mm"].candidates]
    torch_impl = next(i for i in candidates if i.backend == "torch")
    assert torch_impl.fn is impl.scaled_mm and torch_impl.supports is impl.supports
    assert torch_impl.devices == frozenset({"cuda"}) and torch_impl.priority == 15
    # sm_86 has no fp8 tensor cores; a CPU platform is not CUDA.
    for platform, reason in (("sm_86", "needs features fp8"), ("x86_64", "needs a cuda platform")):
        rejected = dict((i.backend, r) for i, r in Engine(ALL_SPECS, Settings(platform=platform)).tables["scaled_mm"].rejected)
        assert reason in rejected["torch"], rejected


# ---------------------------------------------------------------------------------------------
# On the CPU: torch's CPU scaled mm runs per-tensor and per-channel scales, which exercises the
# layouts, the bias handling and the strided operands (the implementation serves CUDA only: on a
# 2-core CPU it measured 0.14 s against the reference's 0.12 s at 128 x 4096 x 4096).

def _cpu_scaled_mm_runs() -> bool:
    """Whether the installed torch runs the implementation's own call on the CPU (2.13 does; 2.11
    has no CPU kernel for the scaled_mm_v2 that torch.nn.functional.scaled_mm calls)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        impl.scaled_mm(a, a, torch.ones(()), torch.ones(()))
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm_runs(), reason="this torch build has no CPU scaled mm")


@needs_cpu_scaled_mm
@pytest.mark.parametrize("name", ["llama3_8b_m1_per_token", "llama3_8b_m128_per_tensor", "small_tensor_scalar_fp32_bias",
                                  "empty_tensor"])
def test_named_cases_on_cpu(name):
    _check(spec.SPEC.case(name).build("cpu", 5), 5)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("layout", ["tensor", "channel"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_bias_and_outputs_on_cpu(layout, out_dtype):
    _check(_build(spec._maker(9, 48, 96, layout, out_dtype=out_dtype, with_bias=True), 3), 3)


def _strided(kwargs: dict) -> dict:
    """a and b as views with padded rows, b shifted by 1 byte (unaligned), strided scales."""
    a, b = kwargs["a"], kwargs["b"]
    wide_a = torch.zeros(a.shape[0], a.shape[1] + 32, dtype=torch.uint8, device=a.device).view(a.dtype)
    wide_a[:, 16:16 + a.shape[1]] = a
    flat_b = torch.zeros(b.numel() + 1, dtype=torch.uint8, device=b.device).view(b.dtype)
    flat_b[1:] = b.reshape(-1)
    scales = {}
    for name in ("scale_a", "scale_b"):
        scale = kwargs[name]
        doubled = torch.full(scale.shape[:-1] + (2 * scale.shape[-1],) if scale.dim() else (2,), float("nan"),
                             device=scale.device)
        view = doubled[..., ::2]
        view.copy_(scale.reshape(view.shape))
        scales[name] = view.reshape(scale.shape) if scale.dim() else view[0]
    return dict(kwargs, a=wide_a[:, 16:16 + a.shape[1]], b=flat_b[1:].view(b.shape), **scales)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("layout", ["tensor", "channel"])
def test_strided_and_unaligned_operands_on_cpu(layout):
    kwargs = _strided(_build(spec._maker(5, 32, 64, layout, with_bias=True), 2))
    assert not kwargs["a"].is_contiguous() and kwargs["b"].data_ptr() % 16
    _check(kwargs, 2)


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU

def _poison(rows: int, cols: int) -> None:
    blocks = [torch.full((rows * cols + extra,), float("nan"), device="cuda") for extra in (0, 64, 4096)]
    del blocks


def _gpu_check(make, seed: int) -> None:
    kwargs = _build(make, seed, "cuda")
    assert ask(impl.supports, spec.SPEC, kwargs) is None
    _poison(kwargs["a"].shape[0], kwargs["b"].shape[0])
    _check(kwargs, seed)


@needs_sm90
@pytest.mark.parametrize("name", [c.name for c in spec.SPEC.cases])
def test_named_cases_on_sm90(name):
    kwargs = spec.SPEC.case(name).build("cuda", 11)
    reason = ask(impl.supports, spec.SPEC, kwargs)
    if reason is not None:
        pytest.skip(f"declined: {reason}")
    _poison(kwargs["a"].shape[0], kwargs["b"].shape[0])
    _check(kwargs, 11)


# Odd M (1, 3, 17, 33: no multiple of 4 or 16), N a multiple of 16 but not of 128 (144, 208: a
# short last N block), K 16 and 48 (per-tensor/channel) or 128..1024 (block).
@needs_sm90
@pytest.mark.parametrize("rows", [1, 3, 17, 33, 256])
@pytest.mark.parametrize("channels, cols, layout", [
    (16, 16, "tensor"), (144, 48, "channel"), (208, 384, "block"), (144, 128, "block"), (256, 1024, "block"),
])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])  # float32 is declined (test_supports)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_odd_shapes_on_sm90(rows, channels, cols, layout, out_dtype, with_bias):
    seed = rows * 7 + channels + cols
    _gpu_check(spec._maker(rows, channels, cols, layout, out_dtype=out_dtype, with_bias=with_bias), seed)


@needs_sm90
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_ue8m0_scales_on_sm90(layout):
    _gpu_check(spec._maker(64, 512, 1024, layout, ue8m0=True), 4)


@needs_sm90
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_strided_and_unaligned_operands_on_sm90(layout):
    kwargs = _strided(_build(spec._maker(9, 256, 512, layout, with_bias=True), 6, "cuda"))
    assert ask(impl.supports, spec.SPEC, kwargs) is None
    _check(kwargs, 6)


@needs_sm90
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_empty_batch_on_sm90(layout):
    kwargs = _build(spec._maker(0, 256, 512, layout), 0, "cuda")
    out = impl.scaled_mm(**kwargs)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


@needs_sm90
def test_fresh_random_shapes_on_sm90():
    generator = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    for _ in range(12):
        layout = ["tensor", "channel", "block"][int(torch.randint(3, (1,), generator=generator))]
        rows = int(torch.randint(1, 300, (1,), generator=generator))
        channels = 16 * int(torch.randint(1, 40, (1,), generator=generator))
        cols = (128 if layout == "block" else 16) * int(torch.randint(1, 12, (1,), generator=generator))
        seed = int(torch.randint(1 << 30, (1,), generator=generator))
        _gpu_check(spec._maker(rows, channels, cols, layout, with_bias=bool(seed & 1)), seed)


@needs_sm90
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_graph_replays_new_inputs_on_sm90(layout):
    make = spec._maker(32, 256, 512, layout, with_bias=True)
    static = _build(make, 0, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            impl.scaled_mm(**static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = impl.scaled_mm(**static)
    for seed in (1, 2):
        fresh = _build(make, seed, "cuda")
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        result.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        spec.SPEC.check_close(result, spec.SPEC.reference(**static), static)
