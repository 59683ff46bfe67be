"""Conformance: every implementation that can run on this machine against its spec's reference,
on every named case, on hypothesis-drawn shapes, with poisoned output memory, directly and
through dispatch."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import kernelmux
from conftest import DEVICE
from kernelmux.engine import detect
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.ops.specs import grouped_topk as grouped_topk_module
from kernelmux.registry import Registry

SPECS = {spec.name: spec for spec in ALL_SPECS}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
# The Triton interpreter costs ~10 ms per program: on the CPU it sees the cases up to this many
# rows here (the triton backend's own tests run the larger ones with one wide block).
INTERPRETER_MAX_ROWS = 64
# ...and moves at most this many bytes (attention over long contexts: ~0.3 s per MiB of KV).
INTERPRETER_MAX_BYTES = 16 << 20


def _runnable_here():
    registry = Registry(SPECS)
    registry.load_entry_points()
    platform = detect()
    runnable = []
    for impl in registry.implementations.values():
        if impl.requirement.check(platform) or impl.missing_packages():
            continue
        if impl.devices and DEVICE not in impl.devices:
            continue
        runnable.append(impl)
    return sorted(runnable, key=lambda impl: impl.key)


IMPLS = _runnable_here()


def _interpreted(impl) -> bool:
    return INTERPRETED and impl.backend == "triton"


def _poison(device: str, nbytes: int) -> None:
    """Leave NaN-filled blocks in the allocator's free lists so outputs the implementation
    allocates start as NaN, not zeros: an unwritten element then fails the comparison."""
    blocks = [torch.full((max(nbytes // 4, 1) + extra,), float("nan"), device=device) for extra in (0, 64, 4096)]
    del blocks


def _check(impl, kwargs, seed, *, drawn: bool = False):
    spec = SPECS[impl.op]
    reason = impl.supports(**kwargs) if impl.supports is not None else None
    if reason is not None:
        # A declined named case is reported as a skip; a declined drawn shape is drawn again.
        if drawn:
            assume(False)
        pytest.skip(f"{impl.key} declines: {reason}")
    # In-place ops write their arguments: the reference runs on its own copy of the inputs.
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    _poison(DEVICE, sum(v.numel() * 8 for v in kwargs.values() if isinstance(v, torch.Tensor)))
    actual = spec.outputs(impl.fn(**kwargs), kwargs)
    expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
    try:
        spec.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{impl.key} (seed {seed}): {error}") from None


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# The gpu-tagged cases (GB-sized caches) share one xdist group: with `-n N --dist loadgroup` they
# run one after another in one worker, not N references of several GiB at once (which ran an
# 80 GB H100 out of memory with 8 workers).
CASE_PARAMS = [
    pytest.param(impl, case, id=f"{impl.key}-{case.name}",
                 marks=[pytest.mark.xdist_group("gpu_cases")] if "gpu" in case.tags else [])
    for impl in IMPLS
    for case in SPECS[impl.op].cases
]


@pytest.mark.parametrize("impl, case", CASE_PARAMS)
def test_named_cases(impl, case):
    if DEVICE == "cpu" and "gpu" in case.tags:
        pytest.skip("gpu-tagged case (a GB-sized perf-goal shape): runs in the GPU suite, not on the CPU")
    seed = _fresh_seed()
    kwargs = case.build(DEVICE, seed)
    first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if _interpreted(impl) and first is not None and first.shape[0] > INTERPRETER_MAX_ROWS:
        pytest.skip(f"Triton interpreter on CPU: {first.shape[0]} rows > {INTERPRETER_MAX_ROWS}; "
                    "runs compiled on the GPU")
    moved = SPECS[impl.op].cost(kwargs).bytes
    if _interpreted(impl) and moved > INTERPRETER_MAX_BYTES:
        pytest.skip(f"Triton interpreter on CPU: the case moves {moved / 2**20:.0f} MiB > "
                    f"{INTERPRETER_MAX_BYTES >> 20} MiB; runs compiled on the GPU")
    try:
        _check(impl, kwargs, seed)
    finally:
        if "gpu" in case.tags and DEVICE == "cuda":
            # The group's worker hands its cached GiB-sized blocks back to the driver: held, they
            # ran the other workers' sub-GiB cases out of memory (a7bcf2a..a78a319, 8 workers).
            del kwargs
            torch.cuda.empty_cache()


GROUPED_TOPK_IMPLS = [impl for impl in IMPLS if impl.op == "grouped_topk"]


@st.composite
def grouped_topk_shapes(draw):
    with_bias = draw(st.booleans())
    groups = draw(st.integers(1, 8))
    group_size = draw(st.integers(2 if with_bias else 1, 40))
    topk_group = draw(st.integers(1, groups))
    return dict(
        tokens=draw(st.sampled_from([0, 1, 2, 3, 17, 33])),
        experts=groups * group_size,
        groups=groups,
        topk_group=topk_group,
        # topk = topk_group * group_size (every kept expert) is a boundary worth drawing often.
        topk=draw(st.one_of(st.just(topk_group * group_size), st.integers(1, topk_group * group_size))),
        scoring_func=draw(st.sampled_from(["softmax", "sigmoid"])),
        with_bias=with_bias,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
    )


@pytest.mark.parametrize("impl", GROUPED_TOPK_IMPLS, ids=lambda impl: impl.key)
@given(shape=grouped_topk_shapes(), seed=st.integers(0, 2**32 - 1))
def test_grouped_topk_random_shapes(impl, shape, seed):
    kwargs = grouped_topk_module._maker(**shape)(torch.device("cpu"), torch.Generator().manual_seed(seed))
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    _check(impl, kwargs, seed, drawn=True)


@pytest.mark.parametrize("impl", GROUPED_TOPK_IMPLS, ids=lambda impl: impl.key)
def test_grouped_topk_non_contiguous_logits(impl):
    kwargs = SPECS["grouped_topk"].case("one_token" if _interpreted(impl) else "deepseek_v3_t64").build(DEVICE, 5)
    wide = torch.randn(kwargs["gating_output"].shape[0], kwargs["gating_output"].shape[1] * 2, device=DEVICE)
    wide[:, ::2] = kwargs["gating_output"]
    kwargs["gating_output"] = wide[:, ::2]
    assert not kwargs["gating_output"].is_contiguous()
    _check(impl, kwargs, 5)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: impl.key)
def test_dispatch_runs_the_preferred_implementation(impl):
    spec = SPECS[impl.op]
    case = next(c for c in spec.cases if "random" in c.tags)  # every spec has small random cases
    kwargs = case.build(DEVICE, _fresh_seed())
    if impl.supports is not None and impl.supports(**kwargs) is not None:
        pytest.skip(f"{impl.key} declines {case.name}")
    try:
        engine = kernelmux.configure(prefer={impl.op: [impl.backend]}, from_env=False)
        fn = engine.resolve(impl.op, **kwargs)
        assert fn is impl.fn
        ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        actual = spec.outputs(getattr(kernelmux.ops, impl.op)(**kwargs), kwargs)
        spec.check_close(actual, spec.outputs(spec.reference(**ref_kwargs), ref_kwargs), kwargs)
    finally:
        kernelmux.reset()


def test_something_runs_here():
    assert {impl.backend for impl in IMPLS} >= {"reference", "cpu"} if DEVICE == "cpu" else {"reference", "triton"}
