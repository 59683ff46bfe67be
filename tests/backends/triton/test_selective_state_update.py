"""The triton backend's selective_state_update against the spec's reference, compiled on a GPU or interpreted on
CPU tensors: every case on fresh seeds with freed memory poisoned under y, the GPU's tile run under the
interpreter too, strided inputs and a strided state cache (its other heads untouched), the softplus at its
extremes, and on the GPU a CUDA-graph replay on new slots and values."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from fakes import ask  # noqa: E402
from graph_replay import capture  # noqa: E402
from kernelmux.backends.triton import selective_state_update as host  # noqa: E402
from kernelmux.conformance import poison_freed_memory  # noqa: E402
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.specs import selective_state_update as spec  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    host._kernel(), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

SPEC = spec.SPEC
# The interpreter's numpy work grows with the state: past this many bytes a case is left to the GPU.
INTERPRETER_MAX_STATE_BYTES = 4 << 20
SMALL = ["small_permuted", "small_padded_bf16"]


def _check(kwargs: dict, what: str) -> None:
    reference_kwargs = dict(kwargs, state=kwargs["state"].clone())
    expected_y = SPEC.reference(**reference_kwargs)
    poison_freed_memory(DEVICE, 4 * kwargs["x"].numel() + 4096)
    actual_y = host.selective_state_update(**kwargs)
    try:
        SPEC.check_close((actual_y, kwargs["state"]), (expected_y, reference_kwargs["state"]), kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def _build(name: str, seed: int) -> dict:
    kwargs = SPEC.case(name).build(DEVICE, seed)
    state = kwargs["state"]
    if not ON_GPU and state.numel() * state.element_size() > INTERPRETER_MAX_STATE_BYTES:
        pytest.skip(f"GPU only: a {state.numel() * state.element_size() >> 20} MiB state takes seconds under the "
                    "Triton interpreter")
    return kwargs


def test_signature_matches_the_spec() -> None:
    assert inspect.signature(host.selective_state_update) == SPEC.signature


def test_declines_state_rows_past_its_limit_and_says_so() -> None:
    kwargs = SPEC.case("small_permuted").build("cpu", 0)
    assert ask(host.supports, SPEC, kwargs, simulate("sm_90")) is None
    wide = {name: kwargs[name].new_zeros(*kwargs[name].shape[:2], 8192) for name in ("B", "C")}
    wide["state"] = kwargs["state"].new_zeros(*kwargs["state"].shape[:3], 8192)
    assert "N = 8192" in ask(host.supports, SPEC, dict(kwargs, **wide), simulate("sm_90"))
    assert "head(s)" in host.describe(SPEC.validate(**kwargs), simulate("sm_90"))


@pytest.mark.parametrize("name", [case.name for case in SPEC.cases])
def test_cases(name: str) -> None:
    for seed in (31, 32):
        _check(_build(name, seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("name", SMALL)
def test_gpu_tile_under_the_interpreter(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The interpreter runs one program of every head; here the GPU's one head per program, and a tile of fewer
    # rows than P (rows masked at the end of a head).
    monkeypatch.setattr(host, "tile_for", lambda heads, p, n: host.Tile(1, 2, 4))
    _check(_build(name, 33), f"{name}, 1 head x 2 rows a program")
    monkeypatch.setattr(host, "tile_for", lambda heads, p, n: host.Tile(4, 4, 4))
    _check(_build(name, 34), f"{name}, 4 heads x 4 rows a program (heads masked past Hh)")
    monkeypatch.setattr(host, "tile_for", lambda heads, p, n: host.Tile(2, 8, 1))
    _check(_build(name, 35), f"{name}, 2 heads x 8 rows a program (rows masked past P)")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs_and_state(state_dtype: torch.dtype) -> None:
    kwargs = _build("small_permuted", 35)
    # The cache a slice of a wider one (every other head), x / z / B / C / dt transposed copies viewed back.
    state = kwargs["state"]
    wide = torch.full((state.shape[0], 2 * state.shape[1], *state.shape[2:]), float("nan"), dtype=state_dtype,
                      device=DEVICE)
    wide[:, ::2] = state.to(state_dtype)
    strided = dict(kwargs, state=wide[:, ::2])
    for name in ("x", "z", "B", "C", "dt"):
        strided[name] = kwargs[name].t().contiguous().t() if name == "dt" else \
            kwargs[name].transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided[name].is_contiguous()
    strided["A"] = torch.stack([kwargs["A"], kwargs["A"]], 1)[:, 0]  # stride 2
    _check(strided, f"strided inputs, {state_dtype} state")
    assert wide[:, 1::2].isnan().all(), "the heads between the slice's were written"


def test_softplus_at_its_extremes() -> None:
    # dt + dt_bias from -40 (softplus ~ 4e-18: log(1 + u) would round it to 0) through the 20 threshold to 60,
    # with A small enough that the decays stay in range: y and the state carry dt' in the dt' x (x) B term.
    kwargs = _build("no_indices", 36)
    requests, heads = kwargs["dt"].shape
    kwargs["dt"] = torch.linspace(-40, 60, requests * heads, device=DEVICE).view(requests, heads)
    kwargs["dt_bias"], kwargs["dt_softplus"] = None, True
    kwargs["A"] = torch.full((heads,), -1e-3, device=DEVICE)
    reference_kwargs = dict(kwargs, state=torch.zeros_like(kwargs["state"]))
    kwargs["state"] = torch.zeros_like(kwargs["state"])
    expected = SPEC.reference(**reference_kwargs)
    actual = host.selective_state_update(**kwargs)
    # From a zero state the new state is exactly dt' x (x) B: relative error, not the absolute tolerance.
    torch.testing.assert_close(kwargs["state"], reference_kwargs["state"], rtol=1e-5, atol=0)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU; the kernel's graph safety is checked on it")
def test_cuda_graph_replay_on_new_slots_and_values() -> None:
    static = _build("mamba2_2.7b_b64_padded", 37)
    graph, y = capture(host.selective_state_update, static)
    for seed in (38, 39):
        fresh = _build("mamba2_2.7b_b64_padded", seed)  # other slots (and padding), other values
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        reference_kwargs = dict(static, state=static["state"].clone())
        expected = SPEC.reference(**reference_kwargs)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        SPEC.check_close((y, static["state"]), (expected, reference_kwargs["state"]), static)
