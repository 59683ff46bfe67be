"""The cuda backend's scaled_mm (Hopper fp8 GEMM with 128-block scales): what it accepts and why not, a direct call
it cannot compute refused before any launch, which tile height it takes, its kernels compiled for sm_90a without
spills and within the register file (NVRTC runs on CPU-only machines); and on an H100/H200 against the spec's
reference, with tiles of 128 and of 256 rows: one tile, M, N and K past the tiles (a 16-wide last K block), more K
steps than ring stages, more tiles than SMs (persistent CTAs, with an odd number of K steps and with one), DeepSeek-V3's
shapes, MN-major activation scales, UE8M0 scales, a bias with every output dtype, padded rows, NaN-poisoned memory and
a CUDA-graph replay."""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import needs_hopper, needs_nvrtc
from fakes import ask, check_against_reference
from kernelmux.backends.cuda import _compile
from kernelmux.backends.cuda import scaled_mm as cuda_mm
from kernelmux.platforms import simulate
from kernelmux.specs import scaled_mm as spec_module
from kernelmux.specs.scaled_mm import SPEC

SM90, SM89 = simulate("sm_90"), simulate("sm_89")
SIZES = {
    # M, N, K and _maker's options
    "one_tile": (128, 128, 128, {}),
    "tails": (300, 264, 1040, {}),  # a partial row tile, column tile and K block (16 of 128)
    "ring_wraps": (256, 256, 128 * 13, {}),  # 13 K steps over 5 stages
    # more tiles than an H200 has SMs (persistent CTAs): an odd number of K steps, and one step a tile
    "persistent_odd_steps": (2048, 2176, 128 * 5, {}),
    "persistent_one_step": (2048, 2176, 128, {}),
    "deepseek_down": (1024, 7168, 2048, {}),
    "deepseek_gate": (512, 2048, 7168, {}),
    "mn_major_scales": (384, 256, 512, {"scale_a_layout": "mn_major"}),
    "ue8m0": (256, 384, 384, {"ue8m0": True}),
    "bias_bf16": (256, 130, 384, {"with_bias": True}),
    "bias_fp16": (260, 256, 256, {"out_dtype": "float16", "with_bias": True}),
    "bias_fp32": (256, 200, 640, {"out_dtype": "float32", "with_bias": True}),
}


def _call(name: str, device: str = DEVICE, seed: int = 3) -> dict:
    rows, channels, cols, options = SIZES[name]
    return spec_module._maker(rows, channels, cols, "block", **options)(torch.device(device),
                                                                       torch.Generator().manual_seed(seed))


def _check(kwargs: dict, what: str) -> torch.Tensor:
    out_bytes = 4 * kwargs["a"].shape[0] * kwargs["b"].shape[0] + 2 ** 20
    return check_against_reference(SPEC, cuda_mm.scaled_mm, kwargs, what, out_bytes)


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signature_matches_the_spec():
    assert inspect.signature(cuda_mm.scaled_mm) == SPEC.signature


def test_takes_prefill_sizes_of_block_scales():
    for name in ("tails", "deepseek_down", "mn_major_scales", "bias_fp32"):
        assert ask(cuda_mm.supports, SPEC, _call(name, "cpu"), SM90) is None, name
    key = SPEC.validate(**_call("tails", "cpu"))
    assert cuda_mm.describe(key, SM90).startswith("Hopper fp8 GEMM")


@pytest.mark.parametrize("maker, platform, reason", [
    (spec_module._maker(256, 256, 256, "block"), SM89, "needs sm_90a"),
    (spec_module._maker(256, 256, 256, "tensor"), SM90, "tensor scales: the kernel promotes 128-block products"),
    (spec_module._maker(256, 256, 256, "channel"), SM90, "channel scales"),
    (spec_module._maker(256, 256, 256, "block", fp8_dtype="e4m3fnuz"), SM90, "e4m3fn only"),
    (spec_module._maker(64, 256, 256, "block"), SM90, "< 256: 128-row tiles would leave SMs idle"),
    (spec_module._maker(256, 256, 200, "block"), SM90, "K = 200: a multiple of 16 only"),
    (spec_module._maker(256, 255, 256, "block"), SM90, "N = 255: even only"),
])
def test_declines_with_reasons(maker, platform, reason):
    kwargs = maker(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert reason in ask(cuda_mm.supports, SPEC, kwargs, platform)


def test_declines_rows_tma_cannot_load():
    kwargs = _call("ue8m0", "cpu")
    rows, cols = kwargs["a"].shape
    wide = torch.zeros(rows, cols + 8, dtype=torch.uint8)
    wide[:, :cols] = kwargs["a"].view(torch.uint8)
    kwargs["a"] = wide.view(torch.float8_e4m3fn)[:, :cols]  # rows K + 8 bytes apart: not 16-byte aligned
    assert "a needs a unit stride" in ask(cuda_mm.supports, SPEC, kwargs, SM90)


@pytest.mark.parametrize("maker, reason", [
    (spec_module._maker(128, 256, 256, "channel"), "block scales expected"),
    (spec_module._maker(128, 256, 200, "block"), "K a multiple of 16 and N even expected, got K = 200"),
    (spec_module._maker(128, 255, 256, "block"), "K a multiple of 16 and N even expected, got K = 256, N = 255"),
])
def test_a_direct_call_it_cannot_compute_raises_before_any_launch(maker, reason):
    # On CPU tensors: the refusal comes before anything would touch a device.
    kwargs = maker(torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=reason):
        cuda_mm.scaled_mm(**kwargs)


def test_row_waves_takes_256_row_tiles_once_they_busy_most_sms():
    sms = 132
    assert cuda_mm.row_waves(4096, 7168, sms) == 2  # 16 x 56 tiles of 256 rows
    assert cuda_mm.row_waves(512, 7168, sms) == 2  # 2 x 56 = 112 >= 0.75 x 132
    assert cuda_mm.row_waves(256, 7168, sms) == 1  # 56: most SMs would idle
    needed = math.ceil(cuda_mm.MIN_SM_SHARE_2_WAVES * sms)  # the threshold, in 256 x 128 tiles at N = 128
    assert cuda_mm.row_waves(256 * needed, 128, sms) == 2
    assert cuda_mm.row_waves(256 * (needed - 1), 128, sms) == 1


@needs_nvrtc
def test_kernels_compile_without_spills():
    # The consumers claim 224 registers (setmaxnreg); the compiled count times 384 threads must fit the 64K file.
    for out_dtype, waves in itertools.product(cuda_mm.OUT_CODES, cuda_mm.STAGES):
        name = cuda_mm.kernel_name(out_dtype, waves)
        module = _compile.compile_module(cuda_mm.source([name]), [name], (9, 0), verbose=True, arch_specific=True)
        assert module.spill_bytes(name) == 0, name
        assert 0 < module.registers(name) * cuda_mm.THREADS <= 65536, name


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU


@needs_hopper
@pytest.mark.parametrize("waves", sorted(cuda_mm.STAGES))
@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_match_the_reference(name, waves, monkeypatch):
    monkeypatch.setattr(cuda_mm, "row_waves", lambda rows, cols, sm_count: waves)
    _check(_call(name), f"{name}, tiles of {waves} x 128 rows")


@needs_hopper
def test_padded_rows():
    kwargs = _call("tails")

    def padded(t: torch.Tensor, extra: int) -> torch.Tensor:  # rows 16-byte aligned, `extra` elements apart
        wide = torch.full((t.shape[0], t.shape[1] + extra), 0x7F, dtype=torch.uint8, device=t.device)  # NaN codes
        wide[:, :t.shape[1]] = t.view(torch.uint8)
        return wide.view(t.dtype)[:, :t.shape[1]]

    _check(dict(kwargs, a=padded(kwargs["a"], 16), b=padded(kwargs["b"], 48)), "padded rows")


@needs_hopper
def test_a_captured_call_replays_on_new_activations():
    kwargs = _call("tails", seed=0)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cuda_mm.scaled_mm(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_mm.scaled_mm(**static)
    fresh = _call("tails", seed=11)
    static["a"].copy_(fresh["a"])
    static["scale_a"].copy_(fresh["scale_a"])
    graph.replay()
    torch.cuda.synchronize()
    SPEC.check_close(out, SPEC.reference(**static), static)
