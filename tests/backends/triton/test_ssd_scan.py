"""The triton backend's ssd_scan against the spec's reference, compiled on a GPU or interpreted on CPU tensors, down
both routes to the chunks' entering states (the walk and chunk states + state passing): every case on fresh seeds
with freed memory poisoned under the outputs, the GPU's tiles run under the interpreter too (chunks split across
tiles, tiles past a short chunk, N over several tiles), strided and sliced inputs (offsets included), chunk-grid
programs past the last real chunk, and on the GPU a CUDA-graph replay on new sequence lengths."""

import dataclasses
import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from fakes import ask  # noqa: E402
from graph_replay import capture  # noqa: E402
from kernelmux.backends.triton import ssd_scan as host  # noqa: E402
from kernelmux.conformance import poison_freed_memory  # noqa: E402
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.specs import ssd_scan as spec  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    host._kernels().chunk_scan_kernel, importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

SPEC = spec.SPEC
# The interpreter's programs are per head and chunk: past this many tokens x heads a case is left to the GPU
# (the Mamba2 cases of 80 heads take seconds each; the conformance suite runs the quick ones).
INTERPRETER_MAX_TOKEN_HEADS = 512
SMALL = ["small_varlen", "small_bf16_limits"]


def _check(kwargs: dict, what: str) -> None:
    expected = SPEC.reference(**kwargs)
    poison_freed_memory(DEVICE, 8 * kwargs["x"].numel() + 4096)
    try:
        SPEC.check_close(host.ssd_scan(**kwargs), expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def _build(name: str, seed: int) -> dict:
    kwargs = SPEC.case(name).build(DEVICE, seed)
    tokens, heads, _ = kwargs["x"].shape
    if not ON_GPU and tokens * heads > INTERPRETER_MAX_TOKEN_HEADS:
        pytest.skip(f"GPU only: {tokens} tokens x {heads} heads take seconds under the Triton interpreter")
    return kwargs


@pytest.fixture(params=["walk", "chunks"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The two routes to the states entering the chunks (host.walks picks one by the walk's programs), each forced."""
    monkeypatch.setattr(host, "walks", lambda programs, device: request.param == "walk")
    return request.param


def test_signature_matches_the_spec() -> None:
    assert inspect.signature(host.ssd_scan) == SPEC.signature


def test_declines_chunks_and_states_past_its_limits_and_says_so() -> None:
    kwargs = SPEC.case("small_varlen").build("cpu", 0)
    assert ask(host.supports, SPEC, kwargs, simulate("sm_90")) is None
    assert "chunk_size 2048" in ask(host.supports, SPEC, dict(kwargs, chunk_size=2048), simulate("sm_90"))
    wide = {name: kwargs[name].new_zeros(*kwargs[name].shape[:2], 2048) for name in ("B", "C")}
    wide["initial_states"] = kwargs["initial_states"].new_zeros(*kwargs["initial_states"].shape[:3], 2048)
    assert "N = 2048" in ask(host.supports, SPEC, dict(kwargs, **wide), simulate("sm_90"))
    assert "chunk 8" in host.describe(SPEC.validate(**kwargs), simulate("sm_90"))


@pytest.mark.parametrize("name", [case.name for case in SPEC.cases])
def test_cases(name: str, route: str) -> None:
    for seed in (41, 42):
        _check(_build(name, seed), f"{name}, seed {seed}")


@pytest.mark.parametrize("name", SMALL)
def test_gpu_tiles_under_the_interpreter(name: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16-wide tiles against chunks of 8 and 4 (rows and pairs past the chunk masked) and against P 4-8, N 8-16;
    # then chunks larger than the tiles (a chunk's pairs and tokens over several tiles and steps).
    small = host.Tiles(cumsum_heads=2, cb_m=16, cb_n=16, cb_k=16, state_p=16, state_n=16, state_t=16, scan_m=16,
                       scan_p=16, scan_k=16, scan_j=16, num_warps=4, scan_warps=4, num_stages=2, passing_block=64,
                       passing_warps=4, walk_p=16, walk_n=16, walk_t=16, walk_warps=4)
    monkeypatch.setattr(host, "tiles_for", lambda q, p, n: small)
    _check(_build(name, 43), f"{name}, 16-wide tiles")
    kwargs = _build(name, 44)
    kwargs["chunk_size"] = 64
    _check(kwargs, f"{name}, chunk 64 over 16-wide tiles")


def test_the_walk_takes_the_states_when_its_programs_fill_the_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "INTERPRETED", False)
    monkeypatch.setattr(host, "_sm_count", lambda device: 132)
    assert not host.walks(131, torch.device("cuda"))
    assert host.walks(132, torch.device("cuda"))


def test_state_dim_over_several_tiles(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # N 40 against 16-wide tiles: C.B and the scan's read of the entering state take three K steps of N (the last
    # partly past N), and the state tiles split N (both routes); 2 groups of 2 heads, chunks of 32 over 16-token steps.
    small = dataclasses.replace(host.tiles_for(32, 8, 40), cb_m=16, cb_n=16, cb_k=16, state_p=16, state_n=16,
                                state_t=16, scan_m=16, scan_p=16, scan_k=16, scan_j=16, walk_p=16, walk_n=16,
                                walk_t=16)
    monkeypatch.setattr(host, "tiles_for", lambda q, p, n: small)
    make = spec._maker((45, 0, 19), 4, 8, 2, 40, torch.float32, 32)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in make(torch.device("cpu"), torch.Generator().manual_seed(50)).items()}
    _check(kwargs, "N 40 over 16-wide tiles")


def test_strided_inputs(route: str) -> None:
    kwargs = _build("small_varlen", 45)
    strided = dict(kwargs)
    for name in ("x", "z", "B", "C"):
        strided[name] = kwargs[name].transpose(0, 2).contiguous().transpose(0, 2)
        assert not strided[name].is_contiguous()
    strided["dt"] = kwargs["dt"].t().contiguous().t()
    for name in ("A", "D", "dt_bias", "cu_seqlens"):
        strided[name] = torch.stack([kwargs[name], kwargs[name]], 1)[:, 0]
    strided["initial_states"] = kwargs["initial_states"].transpose(1, 3).contiguous().transpose(1, 3)
    _check(strided, "strided inputs, offsets and initial states")


def test_many_short_sequences(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 sequences of 0-3 tokens and one of 37: many chunk programs (the grid's bound is T // Q + Bs, capped at T)
    # find no chunk, and with 8 a step the chunk table sums the sequences before a program's over several steps
    # and stores the long sequence's 19 chunks over three.
    monkeypatch.setattr(host, "TABLE_BLOCK", 8)
    lengths = tuple(int(v) for v in torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(7))) + (37,)
    make = spec._maker(lengths, 2, 4, 1, 8, torch.float32, 2)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in make(torch.device("cpu"), torch.Generator().manual_seed(46)).items()}
    _check(kwargs, f"lengths {lengths}, chunk 2")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU; the kernels' graph safety is checked on it")
def test_cuda_graph_replay_on_new_lengths(route: str) -> None:
    static = _build("mamba2_2.7b_t1024_varlen", 47)
    graph, result = capture(host.ssd_scan, static)
    tokens = static["x"].shape[0]
    for seed, lengths in ((48, (700, 0, 1, 323)), (49, (256, 256, 256, 256))):
        assert sum(lengths) == tokens
        fresh = _build("mamba2_2.7b_t1024_varlen", seed)
        fresh["cu_seqlens"] = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        for out in result:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        SPEC.check_close(result, SPEC.reference(**static), static)
