"""The triton backend's kv_cache_write to fp8 caches, bit-exact against quantize_to_cache_fp8 over
every 16-bit input value and scale, by both fp8 routes; the scale read on the device."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from kernelmux.backends.triton import kv_cache_write as host  # noqa: E402
from kernelmux.backends.triton.kv_cache_write import (  # noqa: E402
    LaunchConfig,
    force_software_fp8,
    kv_cache_write,
    native_fp8_cast,
    override_launch_config,
)
from kernelmux.specs.kv_cache_write import SPEC, quantize_to_cache_fp8  # noqa: E402

ON_GPU = DEVICE == "cuda"
FP8 = torch.float8_e4m3fn

if not ON_GPU and not isinstance(
    host._kernel(), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

# The interpreter evaluates the integer fp8 route on NaN and inf lanes too (their codes are then
# replaced), and numpy warns about the arithmetic; the results are checked byte for byte below.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# As in test_kv_cache_write.py: one wide block per program for big batches under the interpreter.
INTERPRETER_MAX_TOKENS = 64
INTERPRETER_WIDE_CONFIG = LaunchConfig(block_t=256, num_warps=4)
# The integer route everywhere; the hardware cast on CUDA devices of compute capability >= 8.9.
ROUTES = ["software", "native"]


def _run(kwargs: dict) -> None:
    if ON_GPU or kwargs["key"].shape[0] <= INTERPRETER_MAX_TOKENS:
        assert kv_cache_write(**kwargs) is None
        return
    with override_launch_config(INTERPRETER_WIDE_CONFIG):
        assert kv_cache_write(**kwargs) is None


def _clone(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _route(route: str):
    """Context for an fp8 route; skips the native one where the device has no hardware cast."""
    if route == "software":
        return force_software_fp8()
    if not native_fp8_cast(torch.device(DEVICE)):
        pytest.skip(
            "GPU only: the native fp8 route needs a CUDA device of compute capability >= 8.9 "
            "(on CPU the interpreter's fp32 -> fp8 cast is not round-to-nearest-even)"
        )
    return force_software_fp8(False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


# Scales: none (no division), 1 (division, exact), scales that are not powers of two (rounded
# quotients, so the fp32 value lands between bf16 grid points), 1 + 2**-23 and 1 - 2**-24 (every
# e4m3 rounding tie of the input grid moved just off the tie, both ways), a large scale (fp32
# subnormal quotients, everything below the smallest e4m3 subnormal), a tiny one (everything
# saturates but zeros and NaN) and a calibrated-looking one.
SCALES = [None, 1.0, 0.3, 0.0173, 1.0 + 2.0**-23, 1.0 - 2.0**-24, 3000.0, 1e-30, 7.5e-3]


def _every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 bit patterns of ``dtype`` (every finite value, both infinities, every NaN) as a
    [16, 16, 256] key: 16 tokens of 16 heads of 256."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).reshape(16, 16, 256)


def _fp8_check_all_values(dtype: torch.dtype, scale) -> None:
    key = _every_16bit_value(dtype).to(DEVICE)
    value = key.flip(0)  # other rows in other slots
    scale_tensor = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    shape = (5, 4, 16, 256)  # 20 slots, 16 written
    kwargs = {
        "key": key,
        "value": value,
        "k_cache": torch.zeros(shape, dtype=FP8, device=DEVICE),
        "v_cache": torch.zeros(shape, dtype=FP8, device=DEVICE),
        "slot_mapping": torch.arange(19, 3, -1, device=DEVICE),
        "k_scale": scale_tensor,
        "v_scale": scale_tensor,
    }
    kv_cache_write(**kwargs)
    # Straight against quantize_to_cache_fp8, element by element, with the first mismatches named.
    got = _bytes(kwargs["k_cache"]).view(20, -1)[4:].flip(0).reshape(-1)
    want = _bytes(quantize_to_cache_fp8(key, scale_tensor)).reshape(-1)
    differ = (got != want).nonzero().flatten()
    inputs = key.cpu().reshape(-1)
    detail = ", ".join(
        f"{inputs[i].float().item():.9g} -> 0x{got[i].item():02x} (want 0x{want[i].item():02x})"
        for i in differ[:8].tolist()
    )
    assert differ.numel() == 0, f"{dtype}, scale {scale}: {differ.numel()} codes differ: {detail}"
    got_v = _bytes(kwargs["v_cache"]).view(20, -1)[4:].flip(0).reshape(-1)
    assert torch.equal(got_v, _bytes(quantize_to_cache_fp8(value, scale_tensor)).reshape(-1))
    # Slots 0..3 were not in the mapping: still zero codes.
    assert not _bytes(kwargs["k_cache"]).view(20, -1)[:4].any()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: "none" if s is None else f"{s:.9g}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_every_input_value(dtype: torch.dtype, scale, route: str) -> None:
    with _route(route):
        _fp8_check_all_values(dtype, scale)


@settings(max_examples=8)
@given(scale=st.floats(2.0**-12, 2.0**12, width=32), bf16=st.booleans())
def test_fp8_every_input_value_drawn_scales(scale: float, bf16: bool) -> None:
    # The default route for the device (the native cast on an H100; the integer one on CPU).
    _fp8_check_all_values(torch.bfloat16 if bf16 else torch.float16, scale)


def test_fp8_hand_worked_codes() -> None:
    # The spec's hand-worked bytes (x / 0.5, saturation, ties to even, signed zero, subnormals).
    values = torch.tensor([1.0, 0.30078125, 0.53125, 0.59375, 1000.0, -1000.0, -0.0, 2.0**-11,
                           3 * 2.0**-11, 0.375, float("nan"), -float("nan"), float("inf")],
                          dtype=torch.bfloat16)
    # torch does not keep a NaN's sign when it builds a bf16 tensor from floats: set the bits.
    values.view(torch.int16)[10:12] = torch.tensor([0x7FC0, 0xFFC0 - 0x10000], dtype=torch.int16)
    expected = [0x40, 0x32, 0x38, 0x3A, 0x7E, 0xFE, 0x80, 0x00, 0x02, 0x34, 0x7F, 0xFF, 0x7E]
    key = values.reshape(-1, 1, 1).to(DEVICE)
    n = values.numel()
    k_cache = torch.zeros(n, 1, 1, 1, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros(n, 1, 1, 1, dtype=FP8, device=DEVICE)
    slots = torch.arange(n, device=DEVICE)
    kv_cache_write(key, key, k_cache, v_cache, slots, torch.tensor(0.5, device=DEVICE), None)
    codes = _bytes(k_cache).flatten().tolist()
    # NaN / 0.5: the NaN's sign is whatever the platform's division gives (x86 keeps it); the
    # reference divides the same way on the same device, so only its code is asserted here.
    reference_codes = _bytes(quantize_to_cache_fp8(key, torch.tensor(0.5, device=DEVICE))).flatten().tolist()
    assert codes[:10] + codes[12:] == expected[:10] + expected[12:]
    assert codes[10:12] == reference_codes[10:12] and all(c & 0x7F == 0x7F for c in codes[10:12])
    # No scale: no division, so the NaN's sign bit survives on every device.
    assert _bytes(v_cache).flatten().tolist()[10:12] == [0x7F, 0xFF]


def test_scale_is_read_on_the_device(monkeypatch) -> None:
    # No .item() (a host sync, and a value frozen into a CUDA graph): the kernel reads the tensor.
    kwargs = SPEC.case("small_fp8_scales").build(DEVICE, 3)
    expected = _clone(kwargs)
    SPEC.reference(**expected)

    def no_item(self):
        raise AssertionError("kv_cache_write read a tensor on the host (.item())")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    _run(kwargs)
    monkeypatch.undo()
    SPEC.check_close(SPEC.outputs(None, kwargs), SPEC.outputs(None, expected), kwargs)


@pytest.mark.skipif(not ON_GPU, reason="GPU only: CUDA graph capture and replay")
def test_cuda_graph_replay_sees_the_current_scale() -> None:
    kwargs = SPEC.case("small_fp8_scales").build(DEVICE, 4)
    initial = _clone(kwargs)
    kv_cache_write(**_clone(kwargs))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_cache_write(**kwargs)
    for k_scale, v_scale in ((0.5, 0.25), (0.0173, 3.0)):
        kwargs["k_scale"].fill_(k_scale)
        kwargs["v_scale"].fill_(v_scale)
        kwargs["k_cache"].copy_(initial["k_cache"])
        kwargs["v_cache"].copy_(initial["v_cache"])
        graph.replay()
        torch.cuda.synchronize()
        expected = _clone(dict(initial, k_scale=kwargs["k_scale"], v_scale=kwargs["v_scale"]))
        SPEC.reference(**expected)
        SPEC.check_close(SPEC.outputs(None, kwargs), SPEC.outputs(None, expected), kwargs)
