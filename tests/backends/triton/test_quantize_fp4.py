"""The triton backend's quantize_nvfp4 and quantize_mxfp4 against the specs' references, bit for bit, compiled
on a GPU or interpreted on CPU tensors: every case on fresh seeds with freed memory poisoned under the outputs,
both scale layouts, every e2m1 rounding boundary, NVFP4's three global-scale routes, strided and sliced inputs,
and on the GPU both fp8 code routes of NVFP4's block scales."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from kernelmux.backends.triton import quantize_mxfp4 as mx_host  # noqa: E402
from kernelmux.backends.triton import quantize_nvfp4 as nv_host  # noqa: E402
from kernelmux.backends.triton._host import force_software_fp8, native_fp8_cast  # noqa: E402
from kernelmux.conformance import poison_freed_memory  # noqa: E402
from kernelmux.specs import quantize_mxfp4 as mx_spec  # noqa: E402
from kernelmux.specs import quantize_nvfp4 as nv_spec  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    getattr(nv_host._kernels()[0], "quantize_nvfp4_kernel"),
    importlib.import_module("triton.runtime.interpreter").InterpretedFunction,
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

OPS = {"quantize_nvfp4": (nv_spec.SPEC, nv_host.quantize_nvfp4),
       "quantize_mxfp4": (mx_spec.SPEC, mx_host.quantize_mxfp4)}
# The interpreter costs ~10 ms per program: on the CPU the cases of more than 64 rows are left to the GPU.
INTERPRETER_MAX_ROWS = 64
CASES = [(op, case.name) for op, (spec, _) in OPS.items() for case in spec.cases]


def _check(op: str, kwargs: dict, what: str) -> None:
    spec, fn = OPS[op]
    expected = spec.reference(**kwargs)
    poison_freed_memory(DEVICE, 4 * kwargs["x"].numel() + 4096)
    try:
        spec.check_close(fn(**kwargs), expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("op", list(OPS))
def test_signature_matches_the_spec(op: str) -> None:
    spec, fn = OPS[op]
    assert inspect.signature(fn) == spec.signature


@pytest.mark.parametrize("op, name", CASES)
def test_cases_bit_for_bit(op: str, name: str) -> None:
    kwargs = OPS[op][0].case(name).build(DEVICE, 11)
    if not ON_GPU and kwargs["x"].shape[0] > INTERPRETER_MAX_ROWS:
        pytest.skip(f"GPU only: {kwargs['x'].shape[0]} rows take seconds under the Triton interpreter")
    _check(op, kwargs, name)


def _boundaries() -> torch.Tensor:
    """fp32 magnitudes on and one ulp either side of every e2m1 midpoint and code (ties go to even), beyond the
    saturation at 6, and zero, each with both signs, as rows of 32."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    values = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1).abs()])
    values = torch.cat([values, -values])
    return torch.cat([values, values.new_zeros(-values.numel() % 31)]).view(-1, 31)


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mxfp4_every_e2m1_boundary(rounding: str) -> None:
    # A 4 in each row makes X = 1 (floor: 2^(2 - 2); ceil: 4 / 6 -> 2^0), so each code is the value's own
    # e2m1 rounding.
    values = _boundaries()
    x = torch.cat([values.new_full((values.shape[0], 1), 4.0), values], 1).to(DEVICE)
    _check("quantize_mxfp4", dict(x=x, rounding=rounding), f"every e2m1 boundary, {rounding}")


def test_nvfp4_every_e2m1_boundary() -> None:
    # gs = 1 and a 6 in every block of 16: sf = e4m3fn(1) = 1 and r = 1, so each code is the value's own
    # rounding.
    values = _boundaries().view(-1)
    values = torch.cat([values, values.new_zeros(-values.numel() % 15)]).view(-1, 15)
    x = torch.cat([values.new_full((values.shape[0], 1), 6.0), values], 1).to(DEVICE)
    _check("quantize_nvfp4", dict(x=x, global_scale=torch.ones((), device=DEVICE)), "every e2m1 boundary")


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 40])
def test_nvfp4_dynamic_global_scale_routes(rows: int) -> None:
    # Up to ONE_PROGRAM_MAX_ROWS rows every program reads all of x; more take the amax partials first. The
    # largest element in the last row makes a wrong route visible in gs.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    x[-1, -1] = 40.0
    _check("quantize_nvfp4", dict(x=x.to(torch.bfloat16).to(DEVICE)), f"{rows} rows, dynamic gs")


@pytest.mark.parametrize("op, name", [("quantize_nvfp4", "small_fp16"), ("quantize_nvfp4", "small_static"),
                                      ("quantize_mxfp4", "small_fp16_ceil"), ("quantize_mxfp4", "nonfinite_blocks")])
def test_several_rows_a_program(op: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Large batches take ROWS rows a program (odd M: the last program's rows masked), and narrower column steps.
    host = nv_host if op == "quantize_nvfp4" else mx_host
    monkeypatch.setattr(host, "PROGRAM_ROWS_FROM", 1)
    monkeypatch.setattr(host, "BLOCK_K", 32)
    _check(op, OPS[op][0].case(name).build(DEVICE, 6), f"{name}, {host.ROWS} rows a program")


@pytest.mark.parametrize("op, name", [("quantize_nvfp4", "small_swizzled_ragged"),
                                      ("quantize_mxfp4", "small_swizzled_ragged")])
def test_swizzled_scales_across_row_tiles(op: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 130 / 131 rows x 5 blocks: every row group of a 128 x 4 tile, a second row tile, and padding that must read
    # zero over poisoned memory; 4 rows a program keeps the interpreter's programs few.
    host = nv_host if op == "quantize_nvfp4" else mx_host
    monkeypatch.setattr(host, "PROGRAM_ROWS_FROM", 1)
    _check(op, OPS[op][0].case(name).build(DEVICE, 8), f"{name}, swizzled scales")


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a view with its last dim strided by 2 inside a larger buffer."""
    out = torch.full((x.shape[0] + 2, 2 * x.shape[1] + 6), 1e4, dtype=x.dtype, device=x.device)
    out[1:-1, 3:-3:2] = x
    return out[1:-1, 3:-3:2]


@pytest.mark.parametrize("op, name", [("quantize_nvfp4", "small_fp16"), ("quantize_nvfp4", "small_static"),
                                      ("quantize_mxfp4", "small_fp32"), ("quantize_mxfp4", "nonfinite_blocks_ceil")])
def test_strided_and_sliced_inputs(op: str, name: str) -> None:
    kwargs = OPS[op][0].case(name).build(DEVICE, 4)
    kwargs["x"] = _strided(kwargs["x"])
    assert not kwargs["x"].is_contiguous()
    _check(op, kwargs, f"{name}, strided")


@pytest.mark.skipif(not ON_GPU, reason="GPU only: the native fp8 route is the hardware cast (sm_89+)")
@pytest.mark.parametrize("name", ["deepseek_v3_m128", "tiny_fp32", "saturating_static", "extremes_fp16"])
def test_nvfp4_both_block_scale_routes(name: str) -> None:
    if not native_fp8_cast(torch.device(DEVICE)):
        pytest.skip("GPU only: this GPU has no hardware e4m3 cast (sm_89+)")
    kwargs = nv_spec.SPEC.case(name).build(DEVICE, 2)
    with force_software_fp8():
        _check("quantize_nvfp4", kwargs, f"{name}, integer route")
    _check("quantize_nvfp4", kwargs, f"{name}, hardware cast")
