"""The cuda backend's fp4_mm (W4A16 GEMV on the tensor cores, up to 32 rows of a): what it accepts and why not,
its compilation without spills (NVRTC runs on CPU-only machines), and on an sm_90 GPU against the spec's
reference: the spec's W4A16 cases, every group count of a's rows (1-8, 9-16, ..., 25-32; M 32, whose size class
supports leaves to triton, by a direct call) and the rows past M,
N off the 16-row tiles, K off the 128-wide steps, both formats, fp16 activations with NVFP4, every output
dtype, padded row strides, NaN-poisoned memory, every code at the bit placement's subnormal (+-0.5), the
scales' extremes, and a CUDA-graph replay on new activations."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import needs_hopper, needs_nvrtc
from fakes import ask, check_against_reference
from kernelmux.backends.cuda import _compile
from kernelmux.backends.cuda import fp4_mm as cuda_fp4
from kernelmux.platforms import simulate
from kernelmux.specs import fp4_mm as spec_module
from kernelmux.specs.fp4_mm import SPEC

SM90, SM89 = simulate("sm_90"), simulate("sm_89")
# The spec's W4A16 cases it takes (M <= 32, K a multiple of 32, MXFP4 with bf16 only).
SERVED = [case.name for case in SPEC.cases if case.name in {
    "gpt_oss_120b_mxfp4_w4a16_m1_n2880_k2880", "gpt_oss_120b_mxfp4_w4a16_m16_n2880_k2880",
    "deepseek_v3_nvfp4_w4a16_m16_n512_k7168", "small_nvfp4_w4a16", "small_nvfp4_w4a16_fp16_fp32out",
    "small_mxfp4_w4a16", "empty_mxfp4_w4a16", "one_token_nvfp4_w4a16", "zero_blocks_nvfp4", "one_block_mxfp4",
    "one_channel_mxfp4"}]
SIZES = {
    # M, N, K, format, and _maker's options
    "m1_tail_step": (1, 40, 2880, "mxfp4", {}),
    "m8_one_group": (8, 64, 1024, "nvfp4", {}),
    "m9_two_groups": (9, 48, 512, "mxfp4", {"out_dtype": "float32"}),
    "m16_fp16": (16, 72, 768, "nvfp4", {"act_dtype": torch.float16, "out_dtype": "float16"}),
    "m17_three_groups": (17, 16, 4096, "nvfp4", {}),
    "m31_four_groups": (31, 100, 320, "mxfp4", {}),
    "m5_n_tail": (5, 7, 96, "nvfp4", {}),
}


def _call(name: str, device: str = DEVICE, seed: int = 3) -> dict:
    rows, channels, cols, fmt, options = SIZES[name]
    return spec_module._maker(rows, channels, cols, fmt, "w4a16", **options)(torch.device(device),
                                                                            torch.Generator().manual_seed(seed))


def _check(kwargs: dict, what: str) -> torch.Tensor:
    operand_bytes = 4 * (kwargs["a"].numel() + kwargs["b"].numel()) + 2 ** 20
    return check_against_reference(SPEC, cuda_fp4.fp4_mm, kwargs, what, operand_bytes)


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signature_matches_the_spec():
    assert inspect.signature(cuda_fp4.fp4_mm) == SPEC.signature


def test_takes_w4a16_at_decode_sizes():
    for name in SERVED:
        assert ask(cuda_fp4.supports, SPEC, SPEC.case(name).build("cpu", 0), SM90) is None, name
    for name in SIZES:
        assert ask(cuda_fp4.supports, SPEC, _call(name, "cpu"), SM90) is None, name


@pytest.mark.parametrize("call, platform, reason", [
    ((4, 16, 64, "nvfp4", "w4a4", {}), SM90, "W4A4 (fp4 activations) multiplies on fp4 tensor cores"),
    ((4, 16, 64, "nvfp4", "w4a16", {}), SM89, "needs sm_90"),
    ((33, 16, 64, "nvfp4", "w4a16", {}), SM90, "up to 63 rows of a (M's class) > 32"),
    ((4, 16, 64, "mxfp4", "w4a16", {"act_dtype": torch.float16}), SM90, "MXFP4 with fp16 activations"),
    ((4, 16, 48, "nvfp4", "w4a16", {}), SM90, "K = 48: a multiple of 32 only"),
])
def test_declines_with_reasons(call, platform, reason):
    rows, channels, cols, fmt, mode, options = call
    kwargs = spec_module._maker(rows, channels, cols, fmt, mode, **options)(torch.device("cpu"),
                                                                             torch.Generator().manual_seed(0))
    assert reason in ask(cuda_fp4.supports, SPEC, kwargs, platform)


def test_declines_rows_it_cannot_load_in_16_bytes():
    kwargs = _call("m8_one_group", "cpu")
    wide = torch.zeros(8, 1024 + 4, dtype=kwargs["a"].dtype)
    wide[:, :1024] = kwargs["a"]
    kwargs["a"] = wide[:, :1024]  # rows of 2056 bytes: not 16-byte aligned
    assert "a needs a unit stride" in ask(cuda_fp4.supports, SPEC, kwargs, SM90)


def test_a_direct_call_past_32_rows_is_refused_before_any_launch():
    kwargs = spec_module._maker(33, 16, 64, "nvfp4", "w4a16")(torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="at most 32 rows"):
        cuda_fp4.fp4_mm(**kwargs)


def test_grids_of_few_tiles_take_more_warps_each_keeping_whole_steps():
    sms = 132
    for tiles, k in itertools.product((1, 3, 128, 180, 448, 512, 4096), (32, 320, 2048, 2880, 7168, 8192)):
        warps = cuda_fp4.warps_for(tiles, k, sms)
        steps = -(-k // cuda_fp4.STEP_K)
        assert warps in (4, 8, 16), (tiles, k)
        if warps > cuda_fp4.MIN_WARPS:  # doubled: the grid was short of warps and each warp keeps its steps
            assert tiles * warps // 2 < cuda_fp4.WARPS_PER_SM * sms and steps >= warps * cuda_fp4.MIN_STEPS, (tiles, k)
        if warps < cuda_fp4.MAX_WARPS:  # not doubled: the grid was full enough or the steps too few
            assert tiles * warps >= cuda_fp4.WARPS_PER_SM * sms or steps < 2 * warps * cuda_fp4.MIN_STEPS, (tiles, k)
    assert cuda_fp4.warps_for(128, 7168, sms) == 16 and cuda_fp4.warps_for(4096, 7168, sms) == 4


@needs_nvrtc
def test_kernels_compile_without_spills():
    # At most 128 registers: four CTAs of 4 warps (16 warps of loads in flight) on an SM, or one of 16.
    for warps, bf16, nvfp4, out_dtype in itertools.product((4, 8, 16), (True, False), (True, False),
                                                           cuda_fp4.OUT_CODES):
        if not bf16 and not nvfp4:
            continue  # declined: e8m0 scales leave fp16's range
        name = cuda_fp4.kernel_name(warps, bf16, nvfp4, out_dtype)
        module = _compile.compile_module(cuda_fp4.source([name]), [name], (9, 0), verbose=True)
        assert module.spill_bytes(name) == 0, name
        assert 0 < module.registers(name) <= 128, name


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU


@needs_hopper
@pytest.mark.parametrize("seed", (0, 7))
@pytest.mark.parametrize("name", SERVED)
def test_spec_cases_match_the_reference(name, seed):
    _check(SPEC.case(name).build(DEVICE, seed), f"{name} seed {seed}")


@needs_hopper
@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_match_the_reference(name):
    _check(_call(name), name)


@needs_hopper
@pytest.mark.parametrize("warps", (4, 8, 16))
@pytest.mark.parametrize("name", ("m1_tail_step", "m31_four_groups", "m5_n_tail"))
def test_every_warp_count(name, warps, monkeypatch):
    monkeypatch.setattr(cuda_fp4, "warps_for", lambda *_: warps)
    _check(_call(name), f"{name} at {warps} warps")


@needs_hopper
def test_32_rows_by_a_direct_call():
    _check(spec_module._maker(32, 40, 256, "nvfp4", "w4a16")(torch.device(DEVICE), torch.Generator().manual_seed(5)),
           "M 32")


@needs_hopper
def test_padded_row_strides():
    kwargs = _call("m9_two_groups")

    def padded(t: torch.Tensor, extra: int) -> torch.Tensor:  # rows 16-byte aligned, `extra` elements apart
        wide = torch.full((t.shape[0], t.shape[1] + extra), 0xFF if t.dtype == torch.uint8 else float("nan"),
                          dtype=t.dtype, device=t.device)
        wide[:, :t.shape[1]] = t
        return wide[:, :t.shape[1]]

    kwargs = dict(kwargs, a=padded(kwargs["a"], 8), b=padded(kwargs["b"], 16), b_scale=padded(kwargs["b_scale"], 3))
    _check(kwargs, "padded rows")


@needs_hopper
@pytest.mark.parametrize("fmt", ("mxfp4", "nvfp4"))
def test_subnormal_codes_and_extreme_scales(fmt):
    # Every code is +-0.5, the bit placement's subnormal: flushed, the outputs would be 0. The scales of four rows
    # take the extremes: MXFP4 codes 0, 128, 200 and 0xFF (NaN: that column of the output NaN); NVFP4 e4m3 0x01
    # (2^-9), 0x7E (448) and 0x7F (NaN).
    kwargs = _call("m9_two_groups" if fmt == "mxfp4" else "m8_one_group")
    kwargs["b"].fill_(0x91)
    scale = kwargs["b_scale"].view(torch.uint8)
    extremes = (0, 128, 200, 0xFF) if fmt == "mxfp4" else (0x01, 0x7E, 0x01, 0x7F)
    for row, code in zip((0, 9, 18, 27), extremes):
        scale[row, 1] = code
    out = _check(kwargs, f"{fmt} extremes")
    assert out[:, 27].isnan().all() and not out[:, :27].isnan().any()


@needs_hopper
def test_a_captured_call_replays_on_new_activations():
    kwargs = _call("m17_three_groups", seed=0)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cuda_fp4.fp4_mm(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_fp4.fp4_mm(**static)
    static["a"].copy_(_call("m17_three_groups", seed=11)["a"])
    graph.replay()
    torch.cuda.synchronize()
    SPEC.check_close(out, SPEC.reference(**static), static)
