"""The cuda backend's quantize_fp8: what it accepts and why not, a direct call it cannot compute refused before any
launch, its kernels compiled for sm_90 (NVRTC runs on CPU-only machines) without spills and against their params
mirrors, the ue8m0 quotient's exactness (on the CPU); and on a Hopper GPU against the spec's reference, bit for
bit: every case it serves on fresh seeds with poisoned memory, every granularity x both scale layouts x ue8m0,
every finite bf16 value shuffled into rows and groups, tiny rows near the floors, huge values, strided and sliced
inputs, odd T and widths off a CTA's, both per_tensor routes and both per_token routes, and CUDA-graph replay."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import finite_bf16_values, needs_nvrtc, poison_allocator
from fakes import ask
from kernelmux.backends.cuda import _compile
from kernelmux.backends.cuda import quantize_fp8 as cuda_quantize
from kernelmux.platforms import simulate
from kernelmux.specs.quantize_fp8 import SPEC

SM90, SM89 = simulate("sm_90"), simulate("sm_89")
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == cuda_quantize.CAPABILITY
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU (Hopper): runs the kernels; runs in the "
                                                        "GPU suite")
GRANULARITIES = ["per_tensor", "per_token", "per_group"]


def _call(rows: int, cols: int, granularity: str = "per_group", dtype=torch.bfloat16, device: str = "cpu",
          seed: int = 0, scale: float = 1.0, **options) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * scale).to(dtype)
    return dict(x=x.to(device), granularity=granularity, **options)


def _check(kwargs: dict, what: str) -> None:
    """The cuda kernels take the call and match the reference bit for bit, over NaN-poisoned allocator blocks."""
    assert ask(cuda_quantize.supports, SPEC, kwargs, SM90) is None, what
    full = {"group_size": 128, "ue8m0": False, "fp8_dtype": "e4m3fn", "scale_layout": "k_major", **kwargs}
    expected = SPEC.reference(**full)
    poison_allocator(4 * kwargs["x"].numel() + 4096)
    actual = cuda_quantize.quantize_fp8(**full)
    try:
        SPEC.check_close(actual, expected, full)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


# ---------------------------------------------------------------------------------------------
# Host side (any machine)


def test_signature_matches_the_spec():
    assert inspect.signature(cuda_quantize.quantize_fp8) == SPEC.signature


@pytest.mark.parametrize("call, platform, reason", [
    (dict(fp8_dtype="e4m3fnuz"), SM90, "fp8_dtype 'e4m3fnuz': e4m3fn codes only"),
    ({}, SM89, "needs sm_90 (Hopper"),
    (dict(cols=200 + 4), SM90, "K = 204: needs a multiple of 8"),
    (dict(group_size=96), SM90, "group_size = 96: needs 8 x a power of two up to 256"),
    (dict(group_size=512), SM90, "group_size = 512: needs 8 x a power of two"),
    (dict(sliced=True), SM90, "x needs a unit stride along K and 16-byte aligned"),
])
def test_declines_with_reasons(call, platform, reason):
    call = dict(call)
    cols = call.pop("cols", 256)
    kwargs = _call(6, cols, **{k: v for k, v in call.items() if k != "sliced"})
    if call.get("sliced"):
        kwargs["x"] = kwargs["x"][:, 4:252]  # K 248, but 8 bytes off 16-byte alignment: no 16-byte loads
    assert reason in ask(cuda_quantize.supports, SPEC, kwargs, platform)


def test_takes_the_goal_shapes_and_every_granularity():
    for granularity in GRANULARITIES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for cols in (2048, 7168):
                kwargs = _call(3, cols, granularity, dtype, ue8m0=True, scale_layout="mn_major")
                assert ask(cuda_quantize.supports, SPEC, kwargs, SM90) is None, (granularity, dtype, cols)
    assert ask(cuda_quantize.supports, SPEC, _call(2, 256, group_size=64), SM90) is None
    assert ask(cuda_quantize.supports, SPEC, _call(2, 256, dtype=torch.float32, group_size=4), SM90) is None
    key = SPEC.validate(**_call(2, 7168, group_size=128))
    assert cuda_quantize.describe(key, SM90).startswith("one launch: warp tasks of")


@pytest.mark.parametrize("call, reason", [
    (dict(fp8_dtype="e4m3fnuz"), "fp8_dtype: the cuda kernels write e4m3fn codes only, got 'e4m3fnuz'"),
    (dict(cols=204), "x: K a multiple of 8 expected for torch.bfloat16, got 204"),
    (dict(group_size=96), "group_size: 8 x a power of two up to 256 expected for torch.bfloat16, got 96"),
    (dict(sliced=True), "x: 16-byte aligned data and row stride expected"),
    (dict(transposed=True), r"x: a unit stride along K expected, got strides \(1, 6\)"),
])
def test_a_direct_call_it_cannot_compute_raises_before_any_launch(call, reason):
    # On CPU tensors: the refusal comes before anything would touch a device.
    call = dict(call)
    sliced, transposed = call.pop("sliced", False), call.pop("transposed", False)
    kwargs = _call(6, call.pop("cols", 256), **call)
    if sliced:
        kwargs["x"] = kwargs["x"][:, 4:252]
    if transposed:
        kwargs["x"] = kwargs["x"].t().contiguous().t()
    with pytest.raises(ValueError, match=reason):
        cuda_quantize.quantize_fp8(**kwargs)


def test_task_division_by_a_multiply():
    for divisor in list(range(1, 600)) + [7, 4095, 2**20 + 3, 2**31 - 1]:
        magic, shift = cuda_quantize.division(divisor)
        assert magic < 2**32
        for n in (0, 1, divisor - 1, divisor, divisor + 1, 12345677, 2**31 - 1):
            assert (n * magic) >> shift == n // divisor, (divisor, n)


def test_a_power_of_two_scale_divides_by_one_multiply():
    # Under ue8m0 the kernels take x * r, r = 1 / 2^k built from the scale's exponent bits: the IEEE quotient
    # itself, for every finite bf16 value (subnormal quotients included) and scales from 2^-126 to 2^120.
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[values.isfinite()]
    for exponent in (-126, -100, -64, -7, 0, 1, 9, 64, 120):
        scale = torch.tensor([2.0 ** exponent], dtype=torch.float32)
        bits = scale.view(torch.int32)
        reciprocal = ((254 << 23) - (bits & 0x7F800000)).view(torch.float32)
        assert float(reciprocal) == 2.0 ** -exponent
        product, quotient = values * reciprocal, values / scale
        assert torch.equal(product.view(torch.int32), quotient.view(torch.int32)), exponent


@needs_nvrtc
def test_every_kernel_compiles_for_sm90_without_spills():
    # Registers within the launch bounds' share of the register file: kToken's token_max_warps, the other row modes'
    # 1024 threads; the group kernels' 256 threads leave 255.
    limits = {cuda_quantize.group_kernel_name(kind, ue8m0, lanes, cuda_quantize.GROUP_SLOTS): 255
              for kind in cuda_quantize.KINDS.values() for ue8m0 in (False, True) for lanes in (1, 8, 16, 32)}
    for kind, ue8m0, (mode_name, mode), vecs in itertools.product(
            cuda_quantize.KINDS.values(), (False, True), cuda_quantize.ROW_MODES.items(), (1, 2, 4, 8)):
        threads = 32 * cuda_quantize.token_max_warps(vecs) if mode_name == "token" else 1024
        limits[cuda_quantize.row_kernel_name(kind, ue8m0, mode, vecs)] = 65536 // threads
    groups = [name for name in limits if name.startswith("quantize_groups")]
    rows = [name for name in limits if name.startswith("quantize_rows")]
    module = _compile.compile_module(cuda_quantize.source(groups, rows), groups + rows, (9, 0), verbose=True)
    for name, limit in limits.items():
        assert module.spill_bytes(name) == 0, name
        assert module.registers(name) <= limit, name


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU


@needs_hopper
@pytest.mark.parametrize("name", [case.name for case in SPEC.cases])
def test_cases_it_serves_bit_for_bit(name):
    kwargs = SPEC.case(name).build(DEVICE, 21)
    if ask(cuda_quantize.supports, SPEC, kwargs, SM90) is not None:
        pytest.skip(f"declined: {ask(cuda_quantize.supports, SPEC, kwargs, SM90)}")
    _check(kwargs, name)


@needs_hopper
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("scale_layout", ["k_major", "mn_major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_granularity_layout_and_dtype(granularity, ue8m0, scale_layout, dtype):
    # Magnitudes from 1e-3 to 1e4; odd T; widths of whole tasks (2048, 7168) and ragged (1000: 7 groups and 104).
    for rows, cols, magnitude in ((1, 7168, 1.0), (7, 1000, 1e4), (33, 2048, 1e-3), (130, 7168, 30.0)):
        _check(_call(rows, cols, granularity, dtype, DEVICE, seed=rows, scale=magnitude, ue8m0=ue8m0,
                     scale_layout=scale_layout), f"{rows} x {cols} x {magnitude}, {dtype}")


@needs_hopper
@pytest.mark.parametrize("group_size", [8, 16, 32, 64, 256])
def test_other_group_sizes(group_size):
    for ue8m0 in (False, True):
        _check(_call(5, 1032, "per_group", device=DEVICE, group_size=group_size, ue8m0=ue8m0, scale=50.0),
               f"groups of {group_size}")
    _check(_call(5, 1032, "per_group", torch.float32, DEVICE, group_size=group_size // 2, scale=50.0),
           f"fp32, groups of {group_size // 2}")


@needs_hopper
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_every_finite_bf16_value_bit_for_bit(granularity, ue8m0):
    # Each finite bf16 value (subnormals, both zeros, up to 3.4e38) meets the scale of the random row or group it
    # was shuffled into: the reciprocal, its FMA correction and the sign bit against the IEEE division.
    for seed, width in ((0, 128), (1, 1024)):
        _check(dict(x=finite_bf16_values(seed, width).to(DEVICE), granularity=granularity, ue8m0=ue8m0),
               f"{granularity}, shuffle {seed}, rows of {width}")


# (row maximum, value): quotients near an e4m3 boundary whose FMA correction underflows unless the row is rescaled
# (the triton backend's exact search, tests/backends/triton/test_quantize_fp8.py).
TINY_ROWS = [(float.fromhex(amax), float.fromhex(value)) for amax, value in [
    ("0x1.f64dfcp-107", "0x1.9c9b7cp-121"), ("0x1.bfa6ecp-115", "0x1.8fb078p-128"),
    ("0x1.842a72p-113", "0x1.764d80p-127"), ("0x1.aa7886p-117", "0x1.02edc0p-129"),
    ("0x1.071a18p-108", "0x1.77dc24p-125"), ("0x1.456154p-110", "0x1.51003cp-123")]]


@needs_hopper
@pytest.mark.parametrize("granularity", ["per_token", "per_tensor"])
def test_tiny_and_huge_rows(granularity):
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(len(TINY_ROWS), 64, generator=gen) * torch.tensor([[amax] for amax, _ in TINY_ROWS])
    x[:, 0] = torch.tensor([amax for amax, _ in TINY_ROWS])
    x[:, 1] = torch.tensor([value for _, value in TINY_ROWS])
    x[:, 2] = -x[:, 1]
    rows = range(len(TINY_ROWS)) if granularity == "per_tensor" else [slice(None)]
    for row in rows:  # per_tensor: each row alone, so its own maximum sets the scale
        _check(dict(x=x[row].reshape(-1, 64).to(DEVICE), granularity=granularity), f"tiny rows {row}")
    # fp32 subnormals only (scale floor 2^-126), zeros of both signs, the fp32 and bf16 maxima.
    tiny = (torch.randn(5, 64, generator=gen) * 1e-40).to(DEVICE)
    tiny[:, 5], tiny[:, 6] = 0.0, -0.0
    huge = torch.randn(5, 64, generator=gen) * 1e30
    huge[:, 0] = torch.tensor([3.4028234663852886e38, -3.389531389e38, 448.0, -1e38, 1e-30])
    for ue8m0 in (False, True):
        _check(dict(x=tiny, granularity=granularity, ue8m0=ue8m0), "fp32 subnormal rows")
        _check(dict(x=huge.to(DEVICE), granularity=granularity, ue8m0=ue8m0), "fp32 rows up to its max")
        bf16_max = torch.finfo(torch.bfloat16).max  # fp32's maximum would round to bf16's Inf (codes unspecified)
        _check(dict(x=huge.clamp(-bf16_max, bf16_max).to(torch.bfloat16).to(DEVICE), granularity=granularity,
                    ue8m0=ue8m0), "bf16 rows up to its max")


@needs_hopper
def test_zero_rows_and_groups():
    x = torch.randn(9, 1024, device=DEVICE)
    x[::2] = 0.0
    x[1, :128] = -0.0
    x[3, 512:640] = 1e-30  # a group under the 1e-4 amax floor
    for granularity in GRANULARITIES:
        for ue8m0 in (False, True):
            _check(dict(x=x.to(torch.bfloat16), granularity=granularity, ue8m0=ue8m0), f"{granularity} zeros")
    _check(dict(x=torch.zeros(6, 256, device=DEVICE, dtype=torch.bfloat16), granularity="per_tensor"), "all zero")


@needs_hopper
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_strided_and_sliced_inputs(granularity):
    # Row strides larger than K (16-byte aligned), NaN around the slice: never read.
    wider = torch.full((12, 1200), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    wider[1:10, 64:1064] = (torch.randn(9, 1000, device=DEVICE) * 7).to(torch.bfloat16)
    x = wider[1:10, 64:1064]
    assert not x.is_contiguous()
    for layout in ("k_major", "mn_major"):
        _check(dict(x=x, granularity=granularity, scale_layout=layout), f"{granularity}, strides {x.stride()}")


@needs_hopper
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 4097])
@pytest.mark.parametrize("one_cta_max_rows", [0, 1 << 30], ids=["two-passes", "one-cta"])
def test_both_per_tensor_routes(rows, one_cta_max_rows, monkeypatch):
    # Row counts below, at and above a CTA's rows; the maximum in the last rows (the second pass takes them first).
    monkeypatch.setattr(cuda_quantize, "TENSOR_ONE_CTA_MAX_ROWS", one_cta_max_rows)
    x = torch.randn(rows, 520, device=DEVICE)
    x[-1, 7] = 300.0
    for ue8m0 in (False, True):
        _check(dict(x=x.to(torch.bfloat16), granularity="per_tensor", ue8m0=ue8m0), f"{rows} rows, ue8m0 {ue8m0}")


def test_row_ctas_hold_their_rows_up_to_the_widest():
    widest = cuda_quantize.token_max_warps(cuda_quantize.MAX_ROW_VECS) * 32 * cuda_quantize.MAX_ROW_VECS
    for vectors in (1, 32, 100, 256, 896, 2048, 2049, 4096, 10000):
        warps, vecs = cuda_quantize.row_shape(vectors)
        assert vecs in (1, 2, 4, 8) and warps in (1, 2, 4, 8, 16) and warps <= cuda_quantize.token_max_warps(vecs)
        if vectors <= widest:
            assert warps * 32 * vecs >= vectors and (warps == 1 or warps * 16 * vecs < vectors), vectors  # the fewest
        else:
            assert (warps, vecs) == (cuda_quantize.token_max_warps(vecs), cuda_quantize.MAX_ROW_VECS), vectors
    assert cuda_quantize.row_shape(256) == (4, 2) and cuda_quantize.row_shape(896) == (4, 8)  # H 2048 and 7168


def test_per_tensor_ctas_take_more_rows_only_on_a_full_grid():
    assert cuda_quantize.tensor_rows_per_cta(4096, 132) == cuda_quantize.TENSOR_MAX_ROWS_PER_CTA
    assert cuda_quantize.tensor_rows_per_cta(128, 132) == cuda_quantize.tensor_rows_per_cta(5, 132) == 1


@needs_hopper
@pytest.mark.parametrize("cols", [8, 2048, 7168, 16384, 16392, 40000])
def test_per_token_held_and_reread_rows(cols):
    # Rows held in registers (up to 8 warps x 32 x 8 vectors: 16384 bf16) and wider ones read twice.
    for ue8m0 in (False, True):
        _check(_call(3, cols, "per_token", device=DEVICE, seed=cols, scale=30.0, ue8m0=ue8m0), f"{cols} columns")


@needs_hopper
@pytest.mark.parametrize("slots", [1, 2, 8])
def test_group_slots_other_than_the_default(slots, monkeypatch):
    monkeypatch.setattr(cuda_quantize, "GROUP_SLOTS", slots)
    for ue8m0 in (False, True):
        _check(_call(11, 7168, "per_group", device=DEVICE, scale=10.0, ue8m0=ue8m0), f"{slots} slots")


@needs_hopper
def test_empty_batch_launches_nothing():
    for granularity in GRANULARITIES:
        _check(dict(x=torch.empty(0, 1024, device=DEVICE, dtype=torch.bfloat16), granularity=granularity),
               f"{granularity}, T = 0")


@needs_hopper
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_graph_replay_on_new_inputs(granularity):
    static = torch.randn(300, 2048, device=DEVICE).to(torch.bfloat16)
    kwargs = dict(x=static, granularity=granularity, group_size=128, ue8m0=False, fp8_dtype="e4m3fn",
                  scale_layout="mn_major")
    cuda_quantize.quantize_fp8(**kwargs)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = cuda_quantize.quantize_fp8(**kwargs)
    for seed in range(3):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        static.copy_(torch.randn(300, 2048, device=DEVICE, generator=gen) * (seed + 1) * 10)
        graph.replay()
        torch.cuda.synchronize()
        SPEC.check_close((q, scale), SPEC.reference(**kwargs), kwargs)
