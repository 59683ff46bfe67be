"""The cuda backend's quantize_nvfp4 and quantize_mxfp4 (one kernel): what they accept and why not, a direct call
they cannot compute refused before any launch, the kernels compiled for sm_90 (NVRTC runs on CPU-only machines)
without spills, the e2m1 encoder's FFMA route against the spec's encoder for every bf16 value (on the CPU); and on
a Hopper GPU against the spec's reference, bit for bit: every spec case they serve, every format x dtype x scale
layout on fresh inputs of several magnitudes over poisoned memory, every e2m1 boundary and tie, zero, NaN/Inf and
saturating blocks, tiny values, strided and sliced rows, T = 1 and odd T, and CUDA-graph replay."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import finite_bf16_values, needs_nvrtc, poison_allocator
from fakes import ask
from kernelmux.backends.cuda import _compile
from kernelmux.backends.cuda import _quantize_fp4 as fp4
from kernelmux.backends.cuda import quantize_mxfp4 as cuda_mx
from kernelmux.backends.cuda import quantize_nvfp4 as cuda_nv
from kernelmux.platforms import simulate
from kernelmux.specs import quantize_mxfp4 as mx_spec
from kernelmux.specs import quantize_nvfp4 as nv_spec

SM90, SM89 = simulate("sm_90"), simulate("sm_89")
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == fp4.CAPABILITY
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU (Hopper): runs the kernels; runs in the "
                                                        "GPU suite")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = list(nv_spec.SCALE_LAYOUTS)
# (op's host module, spec, extra keyword arguments) of every format the kernel computes.
FORMATS = {
    "nvfp4_given": (cuda_nv, nv_spec.SPEC, lambda device: {"global_scale": torch.tensor(2688.0 / 25.0,
                                                                                         device=device)}),
    "nvfp4_dynamic": (cuda_nv, nv_spec.SPEC, lambda device: {"global_scale": None}),
    "floor": (cuda_mx, mx_spec.SPEC, lambda device: {"rounding": "floor"}),
    "ceil": (cuda_mx, mx_spec.SPEC, lambda device: {"rounding": "ceil"}),
}


def _fn(module):
    return module.quantize_nvfp4 if module is cuda_nv else module.quantize_mxfp4


def _check(fmt: str, x: torch.Tensor, what: str, scale_layout: str = "linear", **extra) -> None:
    """The cuda kernel takes the call and matches the reference bit for bit, over NaN-poisoned allocator blocks."""
    module, spec, options = FORMATS[fmt]
    kwargs = {"x": x, **options(x.device), "scale_layout": scale_layout, **extra}
    assert ask(module.supports, spec, kwargs, SM90) is None, what
    expected = spec.reference(**kwargs)
    poison_allocator(4 * x.numel() + 4096)
    actual = _fn(module)(**kwargs)
    try:
        spec.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{fmt}, {what}: {error}") from None


def _random(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * scale
    x[:, torch.randint(0, cols, (max(cols // 512, 1),), generator=gen)] *= 20.0  # outlier channels
    bound = torch.finfo(dtype).max  # finite after the cast (fp16 overflows near 6.5e4; an Inf's codes are unspecified)
    return x.clamp(-bound, bound).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signatures_match_the_specs():
    assert inspect.signature(cuda_nv.quantize_nvfp4) == nv_spec.SPEC.signature
    assert inspect.signature(cuda_mx.quantize_mxfp4) == mx_spec.SPEC.signature


@pytest.mark.parametrize("module, spec", [(cuda_nv, nv_spec.SPEC), (cuda_mx, mx_spec.SPEC)])
def test_declines_with_reasons(module, spec):
    x = torch.randn(6, 256).to(torch.bfloat16)
    assert "needs sm_90 (Hopper" in ask(module.supports, spec, {"x": x}, SM89)
    sliced = x[:, 4:228]  # K 224, 8 bytes off 16-byte alignment: no 16-byte loads
    assert "x needs a unit stride along K and 16-byte aligned" in ask(module.supports, spec, {"x": sliced}, SM90)
    transposed = torch.randn(256, 6).to(torch.bfloat16).t()
    assert "unit stride along K" in ask(module.supports, spec, {"x": transposed}, SM90)
    assert "x dtype torch.float64: bf16, fp16 or fp32 only" in fp4.shape_reason(torch.float64, 256, 16, True)
    assert "whole 16-byte vectors" in fp4.shape_reason(torch.float32, 16, 2, True)


def test_takes_the_goal_shapes_every_dtype_format_and_layout():
    for dtype, cols, layout in itertools.product(DTYPES, (2880, 7168), LAYOUTS):
        x = torch.randn(3, cols).to(dtype)
        for gs in (None, torch.tensor(1.0)):
            kwargs = {"x": x, "global_scale": gs, "scale_layout": layout}
            assert ask(cuda_nv.supports, nv_spec.SPEC, kwargs, SM90) is None, (dtype, cols, layout)
        for rounding in mx_spec.ROUNDINGS:
            kwargs = {"x": x, "rounding": rounding, "scale_layout": layout}
            assert ask(cuda_mx.supports, mx_spec.SPEC, kwargs, SM90) is None, (dtype, cols, layout, rounding)
    key = nv_spec.SPEC.validate(x=torch.randn(2, 7168).to(torch.bfloat16))
    assert cuda_nv.describe(key, SM90).startswith("two launches: quantize_fp8's per-CTA maxima")
    key = mx_spec.SPEC.validate(x=torch.randn(2, 7168).to(torch.bfloat16))
    assert cuda_mx.describe(key, SM90).startswith("one launch: warp tasks of 4 x 8 blocks of a row, 4 lanes a block")


@pytest.mark.parametrize("module", [cuda_nv, cuda_mx])
@pytest.mark.parametrize("call, reason", [
    ("sliced", "x: 16-byte aligned data and row stride expected"),
    ("transposed", r"x: a unit stride along K expected, got strides \(1, 6\)"),
    ("float64", "x: bf16, fp16 or fp32 expected, got torch.float64"),
])
def test_a_direct_call_it_cannot_compute_raises_before_any_launch(module, call, reason):
    # On CPU tensors: the refusal comes before anything would touch a device.
    x = torch.randn(6, 256).to(torch.bfloat16)
    x = {"sliced": x[:, 4:228], "transposed": torch.randn(256, 6).to(torch.bfloat16).t(),
         "float64": x.double()}[call]
    with pytest.raises(ValueError, match=reason):
        _fn(module)(x)


def test_mxfp4_direct_call_refuses_an_unknown_rounding():
    with pytest.raises(ValueError, match="rounding: 'floor' or 'ceil' expected, got 'up'"):
        cuda_mx.quantize_mxfp4(torch.randn(2, 64).to(torch.bfloat16), rounding="up")


def _magnitude_codes(y: torch.Tensor) -> torch.Tensor:
    """The kernel's e2m1_magnitude in torch: min(|y|, 6), the binade 2^e (e >= 0), RN(m 2^(1-e)) by an fp32 add
    onto 2^23 + 2 (the product is exact, so the add rounds once, as the FFMA does), plus the exponent bits' double;
    the low byte."""
    m = torch.minimum(y.abs(), torch.tensor(6.0))
    binade = torch.clamp_min(m.view(torch.int32) & 0x7F800000, 0x3F800000)
    t = m * (0x7F800000 - binade).view(torch.float32) + 8388610.0
    return ((t.view(torch.int32) + (binade >> 22)) & 0xFF).to(torch.uint8)


def test_the_encoders_ffma_route_is_the_specs_encoder():
    # Every finite bf16 value times factors of both formats' kinds (a power of two, gs / sf ratios, tiny and huge),
    # and every fp32 value within 5000 ulps of each e2m1 midpoint and code value (the ties and their neighbours).
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[values.isfinite()]
    for r in (1.0, 0.25, 2.0**-100, 2.0**100, 2688.0 / 448.0, 7.0 / 3.0, 1e-3, 3.1e5):
        y = values * r
        assert torch.equal(_magnitude_codes(y), nv_spec.encode_e2m1(y) & 7), r
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])
    y = (points.view(torch.int32)[:, None] + torch.arange(-5000, 5000)[None, :]).view(torch.float32).flatten()
    assert torch.equal(_magnitude_codes(y), nv_spec.encode_e2m1(y) & 7)


@needs_nvrtc
def test_every_kernel_compiles_for_sm90_without_spills():
    # Up to 4 slots (8 spills 16 bytes for fp32 MXFP4: not offered).
    names = [fp4.kernel_name(fmt, kind, swizzled, slots) for fmt in fp4.FORMATS.values()
             for kind in fp4.KINDS.values() for swizzled in (False, True) for slots in (1, 2, 3, 4)]
    module = _compile.compile_module(fp4.source(names), names, (9, 0), verbose=True)
    for name in names:
        assert module.spill_bytes(name) == 0, name
        assert module.registers(name) <= 255, name


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU


@needs_hopper
@pytest.mark.parametrize("module, spec", [(cuda_nv, nv_spec.SPEC), (cuda_mx, mx_spec.SPEC)], ids=["nvfp4", "mxfp4"])
def test_cases_it_serves_bit_for_bit(module, spec):
    for case in spec.cases:
        kwargs = case.build(DEVICE, 21)
        if ask(module.supports, spec, kwargs, SM90) is not None:
            continue
        expected = spec.reference(**kwargs)
        poison_allocator(4 * kwargs["x"].numel() + 4096)
        try:
            spec.check_close(_fn(module)(**kwargs), expected, kwargs)
        except AssertionError as error:
            raise AssertionError(f"{case.name}: {error}") from None


@needs_hopper
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("scale_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_format_layout_and_dtype(fmt, scale_layout, dtype):
    # Magnitudes from 1e-3 to 1e4; T 1, odd T and past a 128-row tile; widths of whole tasks (7168) and ragged ones
    # (2880: a last task of 52 of 64 NVFP4 blocks; 96: one partial task; 1056: 33 MXFP4 blocks).
    for rows, cols, magnitude in ((1, 7168, 1.0), (7, 2880, 1e4), (33, 96, 1e-3), (130, 1056, 30.0),
                                  (257, 7168, 3.0)):
        _check(fmt, _random(rows, cols, dtype, seed=rows, scale=magnitude), f"{rows} x {cols} x {magnitude}, {dtype}",
               scale_layout)


@needs_hopper
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_every_slot_count_for_every_format(slots, monkeypatch):
    monkeypatch.setattr(fp4, "SLOTS", slots)
    for fmt in FORMATS:
        _check(fmt, _random(11, 2880, scale=10.0), f"{slots} slots")
        _check(fmt, _random(5, 1056, torch.float32, scale=10.0), f"fp32, {slots} slots")


def _boundaries(block: int) -> torch.Tensor:
    """One row of blocks of ``block``, each a 6 (the block maximum) then e2m1 boundaries, ties and their fp32
    neighbours, both signs."""
    points = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    bits = points.view(torch.int32)
    near = torch.cat([bits - 1, bits, bits + 1]).view(torch.float32)
    near = near[near >= 0]
    values = torch.cat([near, -near])
    values = torch.cat([values, values.new_zeros(-values.numel() % (block - 1))]).view(-1, block - 1)
    return torch.cat([torch.full((values.shape[0], 1), 6.0), values], dim=1).reshape(1, -1)


@needs_hopper
def test_every_e2m1_boundary_and_tie():
    # fp32 inputs: the values next to each midpoint reach the encoder unchanged (r = 1: MXFP4's floor of a block
    # max 6 is 2^0; NVFP4 with gs = 448 gives sf = e4m3(448 * 6 / 6) = 448 and r = 1).
    _check("floor", _boundaries(32).to(DEVICE), "boundaries, r = 1")
    _check("nvfp4_given", _boundaries(16).to(DEVICE), "boundaries, r = 1", global_scale=torch.tensor(448.0,
                                                                                                      device=DEVICE))
    for scale in (2.0**-20, 3.0, 2.0**40):  # the same pattern scaled: r = 2^-k exactly (MXFP4), gs / sf (NVFP4)
        for fmt in FORMATS:
            block = 16 if fmt.startswith("nvfp4") else 32
            _check(fmt, (_boundaries(block) * scale).to(DEVICE), f"boundaries x {scale}")


@needs_hopper
@pytest.mark.parametrize("fmt", ["nvfp4_given", "floor", "ceil"])
def test_every_finite_bf16_value_bit_for_bit(fmt):
    # Each finite bf16 value (subnormals, both zeros, up to 3.4e38) meets the scale of the random block it was
    # shuffled into. NVFP4 with gs 1: e4m3 scales saturate at 448 and underflow to 0 (codes 0) in many blocks.
    for seed, width in ((0, 128), (1, 2880)):
        extra = {"global_scale": torch.tensor(1.0, device=DEVICE)} if fmt == "nvfp4_given" else {}
        _check(fmt, finite_bf16_values(seed, width).to(DEVICE), f"shuffle {seed}, rows of {width}", **extra)


@needs_hopper
def test_zero_nonfinite_saturating_and_tiny_blocks():
    x = torch.randn(9, 1024)
    x[::2] = 0.0
    x[1, :32] = -0.0  # a block of negative zeros: codes 0, not 0x8
    x[3, 64:96] = 1e-30
    for fmt in FORMATS:
        for dtype in DTYPES:
            _check(fmt, x.to(dtype).to(DEVICE), f"zero blocks, {dtype}")
    _check("nvfp4_dynamic", torch.zeros(5, 64, device=DEVICE, dtype=torch.bfloat16), "all zero")
    nonfinite = torch.randn(4, 128)
    nonfinite[0, 3], nonfinite[1, 40], nonfinite[2, 70], nonfinite[3, 127] = float("nan"), float("inf"), \
        float("-inf"), float("nan")
    for fmt, dtype in itertools.product(("floor", "ceil"), DTYPES):
        _check(fmt, nonfinite.to(dtype).to(DEVICE), f"NaN / Inf blocks, {dtype}")
    huge = torch.randn(5, 64) * 1e30
    huge[:, 0] = torch.tensor([3.3895e38, -3.3895e38, 448.0, -1e38, 1e-30])
    for fmt in FORMATS:
        _check(fmt, huge.to(torch.bfloat16).to(DEVICE), "bf16 up to its max")
        _check(fmt, (torch.randn(5, 64) * 1e-18).to(DEVICE), "fp32 ~1e-18")
    for fmt in ("floor", "ceil"):
        _check(fmt, (torch.randn(5, 64) * 1e-39).to(DEVICE), "fp32 subnormals: the exponent clamps at -127")
        _check(fmt, (torch.randn(5, 64) * 1e-6).to(torch.float16).to(DEVICE), "fp16 subnormals")
    # NVFP4 saturation: a passed-in gs far above 2688 / amax puts sf at 448 and elements beyond 6 * 448 / gs at 6.
    for gs in (2688.0, 1e6, 3e38):
        _check("nvfp4_given", _random(3, 48, torch.float32, scale=60.0), f"gs {gs}",
               global_scale=torch.tensor(gs, device=DEVICE))


@needs_hopper
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_strided_and_sliced_inputs(fmt):
    # Row strides larger than K (16-byte aligned), NaN around the slice: never read.
    wider = torch.full((12, 1200), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    wider[1:10, 64:1088] = (torch.randn(9, 1024, device=DEVICE) * 7).to(torch.bfloat16)
    x = wider[1:10, 64:1088]
    assert not x.is_contiguous()
    for layout in LAYOUTS:
        _check(fmt, x, f"strides {x.stride()}", layout)


@needs_hopper
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 129, 4097])
def test_dynamic_scale_with_its_maximum_anywhere(rows):
    # The maximum in the last row, then in the first: every CTA reduces all of quantize_fp8's per-CTA maxima.
    for where in (-1, 0):
        x = torch.randn(rows, 528, device=DEVICE)  # K a multiple of 16
        x[where, 7] = -300.0
        _check("nvfp4_dynamic", x.to(torch.bfloat16), f"{rows} rows, maximum in row {where}")


@needs_hopper
def test_empty_batch_launches_nothing():
    for fmt in FORMATS:
        for layout in LAYOUTS:
            _check(fmt, torch.empty(0, 1024, device=DEVICE, dtype=torch.bfloat16), "T = 0", layout)


@needs_hopper
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_graph_replay_on_new_inputs(fmt):
    module, spec, options = FORMATS[fmt]
    static = torch.randn(300, 2880, device=DEVICE).to(torch.bfloat16)
    kwargs = {"x": static, **options(DEVICE), "scale_layout": "swizzled_128x4"}
    _fn(module)(**kwargs)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _fn(module)(**kwargs)
    for seed in range(3):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        static.copy_(torch.randn(300, 2880, device=DEVICE, generator=gen) * (seed + 1) * 10)
        graph.replay()
        torch.cuda.synchronize()
        spec.check_close(outputs, spec.reference(**kwargs), kwargs)
