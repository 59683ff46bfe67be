"""The triton backend's fp4_mm (W4A16) against the spec's reference, compiled on a GPU or interpreted on CPU
tensors: W4A4 declined with its reason, every W4A16 case on both paths (the GEMVs and the tensor-core tiles)
with freed memory poisoned under the output, tiles smaller and larger than the shapes, strided and sliced
inputs."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from fakes import ask, check_against_reference  # noqa: E402
from kernelmux.backends.triton import fp4_mm as host  # noqa: E402
from kernelmux.backends.triton.fp4_mm import Tiles, fp4_mm, supports  # noqa: E402
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.specs.fp4_mm import SPEC  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    getattr(host._kernels(), "fp4_mm_kernel"), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

W4A16 = [case.name for case in SPEC.cases if SPEC.case(case.name).build("cpu", 0)["a"].dtype != torch.uint8]
W4A4 = [case.name for case in SPEC.cases if case.name not in W4A16]
SMALL = ["small_mxfp4_w4a16", "small_nvfp4_w4a16"]  # one of each format, for the variations below
# The interpreter costs ~10 ms per program: on the CPU the model shapes are left to the GPU.
INTERPRETER_MAX_WEIGHTS = 1 << 16


def _check(kwargs: dict, what: str) -> None:
    out_elements = kwargs["a"].shape[0] * kwargs["b"].shape[0]
    check_against_reference(SPEC, fp4_mm, kwargs, what, 4 * out_elements + 4096)


def _build(name: str, seed: int) -> dict:
    kwargs = SPEC.case(name).build(DEVICE, seed)
    if not ON_GPU and kwargs["b"].numel() * 2 > INTERPRETER_MAX_WEIGHTS:
        pytest.skip(f"GPU only: {name}'s {kwargs['b'].numel() * 2} weights take minutes under the Triton interpreter")
    return kwargs


def test_signature_matches_the_spec() -> None:
    assert inspect.signature(fp4_mm) == SPEC.signature


def test_w4a4_is_declined_with_its_reason() -> None:
    assert W4A4 and W4A16
    kwargs = SPEC.case(W4A4[0]).build("cpu", 0)
    assert "W4A4" in ask(supports, SPEC, kwargs, simulate("sm_90"))
    assert ask(supports, SPEC, SPEC.case(W4A16[0]).build("cpu", 0), simulate("sm_90")) is None


PATHS = ["gemv", "tiles", "dequantize"]


def _route(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call down one path, whatever its M: the GEMVs, the tiled GEMM, or the weights decoded for torch's GEMM
    (which MXFP4 with fp16 activations never takes: those calls run the tiles)."""
    monkeypatch.setattr(host, "GEMV_MAX_ROWS", 1 << 20 if path == "gemv" else 0)
    monkeypatch.setattr(host, "DEQUANTIZE_MIN_ROWS", 0 if path == "dequantize" else 1 << 30)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", W4A16)
def test_cases_match_the_reference(name: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _route(path, monkeypatch)
    _check(_build(name, 5), f"{name}, {path}")


def test_many_rows_decode_the_weights_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host.by_dequantizing(host.DEQUANTIZE_MIN_ROWS, "nvfp4", torch.bfloat16, nvidia=True)
    assert not host.by_dequantizing(host.DEQUANTIZE_MIN_ROWS - 1, "nvfp4", torch.bfloat16, nvidia=True)
    assert not host.by_dequantizing(1 << 20, "mxfp4", torch.float16, nvidia=True)  # e8m0 scales leave fp16's range
    assert host.by_dequantizing(1 << 20, "mxfp4", torch.bfloat16, nvidia=True)
    assert not host.by_dequantizing(1 << 20, "mxfp4", torch.bfloat16, nvidia=False)  # not measured off NVIDIA
    monkeypatch.setattr(host, "DEQUANTIZE_MIN_ROWS", 4)
    key = SPEC.validate(**SPEC.case("small_nvfp4_w4a16").build("cpu", 0))
    assert "the weights decoded once into a dense bfloat16 matrix" in host.describe(key, simulate("sm_90"))
    assert "tiles" in host.describe(key, simulate("gfx942"))


@pytest.mark.parametrize("tiles", [Tiles(16, 16, 32, 1, 4, 2), Tiles(32, 64, 64, 2, 4, 3)],
                         ids=lambda t: f"m{t.block_m}n{t.block_n}k{t.block_k}g{t.group_m}")
@pytest.mark.parametrize("name", SMALL)
def test_other_tiles(name: str, tiles: Tiles, monkeypatch: pytest.MonkeyPatch) -> None:
    _route("tiles", monkeypatch)
    monkeypatch.setattr(host, "tiles_for", lambda rows: tiles)
    _check(_build(name, 6), f"{name} under {tiles}")


@pytest.mark.parametrize("tile", [(4, 32, 2, 2), (16, 64, 4, 3)], ids=lambda t: f"n{t[0]}k{t[1]}w{t[2]}")
def test_other_gemv_tiles(tile: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "GEMV_MAX_ROWS", 1 << 20)
    monkeypatch.setattr(host, "gemv_tile", lambda n, k: tile)
    for name in SMALL:
        _check(_build(name, 8), f"{name} under GEMV tile {tile}")


def test_describe_names_the_path() -> None:
    for name, path in (("one_token_nvfp4_w4a16", "GEMVs"), ("small_mxfp4_w4a16", "tiles 16 x 32")):
        key = SPEC.validate(**SPEC.case(name).build("cpu", 0))
        assert path in host.describe(key, simulate("sm_90")), name


def test_the_gemv_tile_follows_the_weight_size() -> None:
    assert host.gemv_tile(8192, 8192) == host.GEMV_TILE
    assert host.gemv_tile(2880, 2880) == host.GEMV_NARROW_TILE


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with its last dim strided by 2 inside a larger buffer."""
    out = torch.zeros(t.shape[0] + 2, 2 * t.shape[1] + 4, dtype=t.dtype, device=t.device)
    out[1:-1, 2:-2:2] = t
    return out[1:-1, 2:-2:2]


@pytest.mark.parametrize("path", PATHS)
def test_strided_and_sliced_inputs(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _route(path, monkeypatch)
    for name in SMALL:
        kwargs = _build(name, 7)
        kwargs.update(a=_strided(kwargs["a"]), b=_strided(kwargs["b"]), b_scale=_strided(kwargs["b_scale"]))
        assert not kwargs["a"].is_contiguous() and not kwargs["b"].is_contiguous()
        _check(kwargs, f"{name}, strided, {path}")
