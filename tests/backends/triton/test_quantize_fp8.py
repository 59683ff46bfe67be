"""The triton backend's quantize_fp8 against the spec's reference, bit for bit, compiled on a GPU or
interpreted on CPU tensors: support, every case it serves on fresh seeds with freed memory poisoned under
its outputs, both per-tensor routes, strided and sliced inputs, and on the GPU both fp8 code routes."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from kernelmux.backends.triton import quantize_fp8 as host  # noqa: E402
from kernelmux.backends.triton._host import force_software_fp8  # noqa: E402
from kernelmux.backends.triton.quantize_fp8 import quantize_fp8  # noqa: E402
from kernelmux.conformance import poison_freed_memory  # noqa: E402
from kernelmux.specs.quantize_fp8 import SPEC  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    getattr(host._kernels(), "quantize_rows_kernel"), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

# The interpreter costs ~10 ms per program: on the CPU the cases of more than 64 rows (4-18 s each) are
# left to the GPU.
INTERPRETER_MAX_ROWS = 64
SERVED = [case.name for case in SPEC.cases]


def _check(kwargs: dict, what: str) -> None:
    expected = SPEC.reference(**kwargs)
    x = kwargs["x"]
    poison_freed_memory(DEVICE, 4 * x.numel() + 4096)
    try:
        SPEC.check_close(quantize_fp8(**kwargs), expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def test_signature_matches_the_spec() -> None:
    assert inspect.signature(quantize_fp8) == SPEC.signature


def _fnuz_grid_and_ties() -> torch.Tensor:
    """fp32 values covering every e4m3fnuz code's neighbourhood: every finite bf16 value of magnitude <= 240
    (subnormals, zeros of both signs, every exponent) and each midpoint between adjacent codes, with the
    fp32 values just below and above it (ties go to even, the others to the nearer code)."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = every[every.isfinite() & (every.abs() <= 240)]
    codes = torch.arange(0, 0x80, dtype=torch.uint8).view(torch.float8_e4m3fnuz).float()  # 0 .. 240
    mid = (codes[1:] + codes[:-1]) / 2
    ties = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    return torch.cat([grid, ties, -ties])


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_every_e4m3fnuz_code_at_unit_scale(rows_per_program: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of 255 values and a 240: every row's per_token scale is 240 / 240 = 1 exactly, so each code is
    # the value's own e4m3fnuz rounding (torch's cast, the reference's), bit for bit.
    monkeypatch.setattr(host, "TOKEN_ROWS", rows_per_program)
    values = _fnuz_grid_and_ties()
    values = torch.cat([values, values.new_zeros(-values.numel() % 255)]).view(-1, 255)
    x = torch.cat([values.new_full((values.shape[0], 1), 240.0), values], 1).to(DEVICE)
    _check(dict(x=x, granularity="per_token", group_size=128, ue8m0=False, fp8_dtype="e4m3fnuz"),
           f"every e4m3fnuz code, {rows_per_program} rows a program")


@pytest.mark.parametrize("name", SERVED)
def test_cases_bit_for_bit(name: str) -> None:
    kwargs = SPEC.case(name).build(DEVICE, 11)
    if not ON_GPU and kwargs["x"].shape[0] > INTERPRETER_MAX_ROWS:
        pytest.skip(f"GPU only: {kwargs['x'].shape[0]} rows take seconds under the Triton interpreter")
    _check(kwargs, name)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("one_program_max_rows", [0, 1 << 30], ids=["two-passes", "one-program"])
def test_both_per_tensor_routes(rows: int, one_program_max_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Row counts below, at and above a program's rows; the amax row in the last program.
    monkeypatch.setattr(host, "ONE_PROGRAM_MAX_ROWS", one_program_max_rows)
    x = torch.randn(rows, 200, device=DEVICE)
    x[-1, 7] = 300.0
    for ue8m0 in (False, True):
        _check(dict(x=x.to(torch.bfloat16), granularity="per_tensor", group_size=128, ue8m0=ue8m0,
                    fp8_dtype="e4m3fn"), f"{rows} rows, ue8m0 {ue8m0}")


@pytest.mark.parametrize("granularity, group_size", [("per_tensor", 128), ("per_token", 128), ("per_group", 128),
                                                     ("per_group", 100)])
def test_strided_and_sliced_inputs(granularity: str, group_size: int) -> None:
    values = torch.randn(9, 300, device=DEVICE) * torch.rand(9, 1, device=DEVICE) * 10
    wider = torch.full((12, 700), float("nan"), device=DEVICE)  # NaN around the slice: never read
    wider[1:10, 100:400] = values
    for x in (wider[1:10, 100:400], values.t().contiguous().t()):
        assert not x.is_contiguous()
        _check(dict(x=x.to(torch.float16) if x.dtype != torch.float32 else x, granularity=granularity,
                    group_size=group_size, ue8m0=False, fp8_dtype="e4m3fn"), f"{granularity}, strides {x.stride()}")


@pytest.mark.parametrize("cols, one_step_max_cols", [(300, 0), (300, 512), (8200, host.ONE_STEP_MAX_COLS), (1, 1)],
                         ids=["two-passes", "one-step-ragged", "wider-than-one-step", "one-column"])
def test_both_per_token_routes(cols: int, one_step_max_cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of at most ONE_STEP_MAX_COLS columns are read once and kept for their codes; wider ones in two passes.
    monkeypatch.setattr(host, "ONE_STEP_MAX_COLS", one_step_max_cols)
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, cols, generator=gen) * torch.rand(3, 1, generator=gen) * 30).to(torch.bfloat16).to(DEVICE)
    for ue8m0 in (False, True):
        _check(dict(x=x, granularity="per_token", ue8m0=ue8m0), f"{cols} columns, one step up to {one_step_max_cols}")


@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("wide_min", [0, 1 << 30], ids=["wide", "narrow"])
def test_both_per_group_widths(group_size: int, wide_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of a multiple of WIDE_GROUPS groups: WIDE_GROUPS a program when the grid stays large enough, else GROUPS.
    monkeypatch.setattr(host, "WIDE_MIN_PROGRAMS_PER_UNIT", wide_min)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, host.WIDE_GROUPS * group_size, generator=gen) * torch.rand(3, host.WIDE_GROUPS, generator=gen
                                                                                   ).repeat_interleave(group_size, 1)
    x[1, 5 * group_size:6 * group_size] = 0.0  # an all-zero group: the amax floor
    for ue8m0 in (False, True):
        _check(dict(x=(x * 40).to(torch.bfloat16).to(DEVICE), granularity="per_group", group_size=group_size,
                    ue8m0=ue8m0), f"group size {group_size}, wide from {wide_min} programs per unit")


def _finite_bf16_values(seed: int) -> torch.Tensor:
    """Every finite bf16 value, shuffled, as rows of 128 (zeros pad the last)."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([values, values.new_zeros(-values.numel() % 128)]).view(-1, 128)


@pytest.mark.parametrize("granularity", ["per_group", "per_token"])
def test_every_finite_bf16_value_bit_for_bit(granularity: str) -> None:
    # The codes' division (a reciprocal and one FMA correction) against the reference's IEEE division: each
    # finite bf16 value meets the scale of the random row or group it was shuffled into.
    for seed in (0, 1):
        _check(dict(x=_finite_bf16_values(seed).to(DEVICE), granularity=granularity, group_size=128,
                    ue8m0=False), f"{granularity}, shuffle {seed}")


# (row maximum, value): fp32 pairs whose quotient by the row's scale (between 2^-126 and RESCALE_BELOW) is within
# an ulp or three of an e4m3 rounding boundary, where the reciprocal's FMA correction without rescaling
# underflows and picks the other code (found by an exact search).
TINY_ROWS = [(float.fromhex(amax), float.fromhex(value)) for amax, value in [
    ("0x1.f64dfcp-107", "0x1.9c9b7cp-121"), ("0x1.bfa6ecp-115", "0x1.8fb078p-128"),
    ("0x1.842a72p-113", "0x1.764d80p-127"), ("0x1.8630a0p-114", "0x1.942014p-127"),
    ("0x1.aa7886p-117", "0x1.02edc0p-129"), ("0x1.a74c22p-109", "0x1.982dfcp-123"),
    ("0x1.06bca6p-112", "0x1.3f09a6p-125"), ("0x1.071a18p-108", "0x1.77dc24p-125"),
    ("0x1.019522p-111", "0x1.38c762p-124"), ("0x1.37c832p-109", "0x1.d3ac4cp-124"),
    ("0x1.82c86ap-115", "0x1.9098b8p-128"), ("0x1.456154p-110", "0x1.51003cp-123")]]


@pytest.mark.parametrize("granularity", ["per_token", "per_tensor"])
def test_rows_of_tiny_values_bit_for_bit(granularity: str) -> None:
    # Scales between 2^-126 (the floor) and RESCALE_BELOW: the division is rescaled by a power of two, or its
    # FMA residual would underflow. Each row: its maximum, the value near a boundary, and random values below.
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(len(TINY_ROWS), 64, generator=gen) * torch.tensor([[amax] for amax, _ in TINY_ROWS])
    x[:, 0] = torch.tensor([amax for amax, _ in TINY_ROWS])
    x[:, 1] = torch.tensor([value for _, value in TINY_ROWS])
    x[:, 2] = -x[:, 1]
    for row in (range(len(TINY_ROWS)) if granularity == "per_tensor" else [slice(None)]):
        _check(dict(x=x[row].reshape(-1, 64).to(DEVICE), granularity=granularity, ue8m0=False),
               f"{granularity}, tiny rows {row}")


@pytest.mark.skipif(not ON_GPU, reason="GPU only: the native fp8 route is the hardware cast (sm_89+)")
@pytest.mark.parametrize("name", ["deepseek_v3_m128", "extremes_per_token", "llama3_8b_m1024_per_tensor"])
def test_the_integer_code_route_on_the_gpu(name: str) -> None:
    with force_software_fp8():
        _check(SPEC.case(name).build(DEVICE, 12), f"{name}, integer fp8 route")
