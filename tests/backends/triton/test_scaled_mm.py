"""The triton backend's scaled_mm against the spec's reference, compiled on a GPU or interpreted on CPU
tensors: support, every case it serves on fresh seeds with freed memory poisoned under its outputs,
launch configurations with and without split-K over every scale layout, strided, sliced and MN-major
(transposed) operands and scales, and the split and configuration rules."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from fakes import ask  # noqa: E402
from kernelmux.backends.triton import scaled_mm as host  # noqa: E402
from kernelmux.backends.triton.scaled_mm import (  # noqa: E402
    AUTO, LaunchConfig, describe, override_launch_config, scaled_mm, split_count, supports)
from kernelmux.conformance import poison_freed_memory  # noqa: E402
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.specs.quantize_fp8 import quantize_fp8  # noqa: E402
from kernelmux.specs.scaled_mm import SPEC, quantize_weight_blocks  # noqa: E402

ON_GPU = DEVICE == "cuda"
_INTERPRETED_FUNCTION = importlib.import_module("triton.runtime.interpreter").InterpretedFunction
if not ON_GPU and not isinstance(getattr(host._kernels(), "scaled_mm_kernel"), _INTERPRETED_FUNCTION):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

# The interpreter costs ~10 ms a program and more a k-step (1 x 2048 x 7168: 8.6 s): on the CPU the model
# cases are left to the GPU.
INTERPRETER_MAX_MACS = 4e6
SERVED = [case.name for case in SPEC.cases if "fnuz" not in case.name]
# Launch configurations that take every route: one tile and many, k-steps of 32-128 (several a
# scale group), GROUP_M ordering over several row tiles, whole K and 2-3 slices summed.
CONFIGS = [
    LaunchConfig(16, 16, 32, group_m=1, num_warps=1, num_stages=1, split_k=1),
    LaunchConfig(16, 64, 64, group_m=2, num_warps=4, num_stages=2, split_k=2),
    LaunchConfig(32, 32, 128, group_m=4, num_warps=4, num_stages=3, split_k=3),
    LaunchConfig(16, 32, 128, group_m=1, num_warps=4, num_stages=4, split_k=AUTO),
]


def _macs(kwargs: dict) -> int:
    return kwargs["a"].shape[0] * kwargs["b"].shape[0] * kwargs["a"].shape[1]


def _check(kwargs: dict, what: str) -> None:
    expected = SPEC.reference(**kwargs)
    poison_freed_memory(DEVICE, 4 * kwargs["a"].shape[0] * kwargs["b"].shape[0] * 4 + 4096)
    try:
        SPEC.check_close(scaled_mm(**kwargs), expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def test_signature_matches_the_spec() -> None:
    assert inspect.signature(scaled_mm) == SPEC.signature


def test_declines_e4m3fnuz_and_pre_ada_gpus_with_a_reason() -> None:
    fnuz = SPEC.case("small_block_fnuz").build("cpu", 0)
    assert "e4m3fnuz" in ask(supports, SPEC, fnuz, simulate("sm_90"))
    block = SPEC.case("small_block").build("cpu", 0)
    assert "sm_89" in ask(supports, SPEC, block, simulate("sm_80"))
    for platform in ("sm_89", "sm_90", "sm_100"):
        assert ask(supports, SPEC, block, simulate(platform)) is None


@pytest.mark.parametrize("name", SERVED)
def test_cases(name: str) -> None:
    kwargs = SPEC.case(name).build(DEVICE, 11)
    if not ON_GPU and _macs(kwargs) > INTERPRETER_MAX_MACS:
        pytest.skip(f"GPU only: {_macs(kwargs):.1e} multiply-adds take minutes under the Triton interpreter")
    _check(kwargs, name)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}-split{c.split_k}")
@pytest.mark.parametrize("name", ["small_tensor_scalar_fp32_bias", "small_channel_fp16_bias", "small_block",
                                  "both_not_multiple_of_128_block", "n_not_multiple_of_128_block"])
def test_launch_configurations(name: str, config: LaunchConfig) -> None:
    kwargs = SPEC.case(name).build(DEVICE, 5)
    with override_launch_config(config):
        _check(kwargs, f"{name} under {config}")


def _block_operands(rows: int, cols: int, depth: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a, scale_a = quantize_fp8(torch.randn(rows, depth, generator=gen), "per_group", 128, False, "e4m3fn")
    b, scale_b = quantize_weight_blocks(torch.randn(cols, depth, generator=gen) / depth**0.5)
    return dict(a=a.to(DEVICE), b=b.to(DEVICE), scale_a=scale_a.to(DEVICE), scale_b=scale_b.to(DEVICE),
                out_dtype="bfloat16", bias=None)


@pytest.mark.parametrize("split_k", [1, 2])
def test_strided_sliced_and_mn_major_operands(split_k: int) -> None:
    dense = _block_operands(6, 200, 300, 3)
    # a: a slice of a wider buffer whose other bytes are NaN codes (0x7F), never read.
    wide = torch.full((8, 700), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    wide[1:7, 100:400] = dense["a"]
    a = wide[1:7, 100:400]
    # b column-major; the scales MN-major (each group's column contiguous: the TMA layout of DeepGEMM).
    b = dense["b"].t().contiguous().t()
    scale_a = dense["scale_a"].t().contiguous().t()
    scale_b = dense["scale_b"].t().contiguous().t()
    assert not (a.is_contiguous() or b.is_contiguous() or scale_a.is_contiguous())
    with override_launch_config(LaunchConfig(16, 64, 64, split_k=split_k)):
        _check(dict(dense, a=a, b=b, scale_a=scale_a, scale_b=scale_b), f"strided operands, split {split_k}")


@pytest.mark.parametrize("split_k", [1, 3])
def test_channel_scales_and_bias_strided(split_k: int) -> None:
    gen = torch.Generator().manual_seed(4)
    a, scale_a = quantize_fp8(torch.randn(5, 96, generator=gen).to(DEVICE), "per_token", 128, False, "e4m3fn")
    b, scale_b = quantize_fp8(torch.randn(40, 96, generator=gen).to(DEVICE), "per_token", 128, False, "e4m3fn")
    # [M, 1] views of every other element of a longer vector (NaN between: never read).
    scale_a = torch.stack([scale_a[:, 0], torch.full_like(scale_a[:, 0], float("nan"))], 1)[:, :1]
    scale_b = torch.stack([scale_b[:, 0], torch.full_like(scale_b[:, 0], float("nan"))], 1)[:, :1]
    # A bias of every other element too.
    bias = (torch.randn(80, generator=gen) * 0.1).to(torch.float16).to(DEVICE)[::2]
    kwargs = dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype="float16", bias=bias)
    assert scale_a.stride() == (2, 1) and bias.stride() == (2,)
    with override_launch_config(LaunchConfig(16, 32, 32, split_k=split_k)):
        _check(kwargs, f"channel scales and bias with stride 2, split {split_k}")


def test_split_count() -> None:
    config = LaunchConfig(16, 64, 128)  # AUTO
    # 1 x 7168 x 16384: 112 tiles on 132 SMs -> 2 slices; 1 x 2048 x 7168: 32 tiles -> 5.
    assert split_count(config, 1, 7168, 16384, 132) == 2
    assert split_count(config, 1, 2048, 7168, 132) == 5
    # Slices keep MIN_SPLIT_STEPS k-steps: K 1024 (8 steps) splits at most in 2.
    assert split_count(config, 1, 64, 1024, 132) == 2
    assert split_count(config, 1, 64, 256, 132) == 1
    assert split_count(config, 1, 64, 1 << 20, 10_000) == host.MAX_SPLITS
    # Enough tiles: whole K.
    assert split_count(config, 16, 36864, 7168, 132) == 1
    # An explicit count, at most K's steps.
    assert split_count(LaunchConfig(16, 64, 128, split_k=3), 1, 64, 1024, 132) == 3
    assert split_count(LaunchConfig(16, 64, 128, split_k=64), 1, 64, 1024, 132) == 8


def test_heuristic_and_describe() -> None:
    assert host.launch_config(1).block_m == 16 and host.launch_config(33).block_m == 64
    assert host.launch_config(4096) == LaunchConfig(128, 128, num_warps=8, num_stages=3, split_k=1)
    key = SPEC.validate(**SPEC.case("one_token_block").build("cpu", 0))
    text = describe(key, simulate("sm_90"))
    assert "tile 16 x 64" in text and "heuristic" in text and "K split to fill the SMs" in text


@pytest.mark.parametrize("bad, field", [
    (LaunchConfig(16, 48, 128), "block_n"),
    (LaunchConfig(16, 64, 16), "block_k"),
    (LaunchConfig(16, 64, 256), "block_k"),
    (LaunchConfig(16, 64, 128, split_k=-1), "split_k"),
])
def test_override_rejects_bad_configurations(bad: LaunchConfig, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        with override_launch_config(bad):
            pass
