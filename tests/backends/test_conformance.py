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
from kernelmux.conformance import poison_freed_memory
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import detect
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import grouped_topk as grouped_topk_module
from kernelmux.registry import Registry

SPECS = {spec.name: spec for spec in ALL_SPECS}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
# The Triton interpreter costs ~10 ms per program: on the CPU it sees the cases up to this many
# rows here (the triton backend's own tests run the larger ones with one wide block).
INTERPRETER_MAX_ROWS = 64
# ...and moves at most this many bytes (attention over long contexts: ~0.3 s per MiB of KV; the fp8 GEMMs'
# 14.7 MB weights ~10 s a case, fp4_mm's 2880 x 2880 8-25 s): past it the GPU suite's conformance runs the case
# compiled, and each backend's own tests run small shapes under the interpreter.
INTERPRETER_MAX_BYTES = 4 << 20


def _runnable_here():
    registry = Registry(SPECS)
    registry.load_entry_points()
    platform = detect()
    runnable = []
    for impl in registry.implementations.values():
        # platform_problem includes the static check, where a vendor backend says its package is missing.
        if impl.platform_problem(platform) or impl.missing_packages():
            continue
        if impl.devices and DEVICE not in impl.devices:
            continue
        runnable.append(impl)
    return sorted(runnable, key=lambda impl: impl.key)


IMPLS = _runnable_here()
PLATFORM = detect()


def _interpreted(impl) -> bool:
    return INTERPRETED and impl.backend == "triton"


def _answer(impl, kwargs) -> str | None:
    """``impl``'s answer to a call with ``kwargs``, as dispatch would ask it: from the dispatch key
    and the platform of the inputs' device."""
    if impl.supports is None:
        return None
    key = SPECS[impl.op].validate(**kwargs)
    return impl.supports(key, PLATFORM)


def _check(impl, kwargs, seed, *, drawn: bool = False):
    spec = SPECS[impl.op]
    reason = _answer(impl, kwargs)
    if reason is not None:
        # A declined named case is reported as a skip; a declined drawn shape is drawn again.
        if drawn:
            assume(False)
        pytest.skip(f"{impl.key} declines: {reason}")
    # In-place ops write their arguments: the reference runs on its own copy of the inputs.
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    poison_freed_memory(DEVICE, sum(v.numel() * 8 for v in kwargs.values() if isinstance(v, torch.Tensor)))
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


@st.composite
def routing_shapes(draw):
    """Half of the draws any shape, half DeepSeek-V3-style routing (sigmoid, a bias, renormalized,
    fp32 logits; half of those DeepSeek-V3's own groups, else up to 32 experts a group, topk <= 8):
    the family vendor kernels serve, drawn often enough that an implementation taking only it is
    tested on many inputs, not filtered away."""
    if draw(st.booleans()):
        return draw(grouped_topk_shapes())
    if draw(st.booleans()):
        groups, group_size, topk_group, topk = 8, 32, 4, 8  # DeepSeek-V3 / R1
    else:
        groups = draw(st.integers(1, 8))
        group_size = draw(st.integers(2, 32))
        topk_group = draw(st.integers(1, groups))
        topk = draw(st.integers(1, min(8, topk_group * group_size)))
    return dict(tokens=draw(st.sampled_from([0, 1, 2, 3, 17, 33])), experts=groups * group_size, groups=groups,
                topk_group=topk_group, topk=topk,
                scoring_func="sigmoid", with_bias=True, dtype=torch.float32, renormalize=True,
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))


@pytest.mark.parametrize("impl", GROUPED_TOPK_IMPLS, ids=lambda impl: impl.key)
@given(shape=routing_shapes(), seed=st.integers(0, 2**32 - 1))
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
    if _answer(impl, kwargs) is not None:
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


# ---------------------------------------------------------------------------------------------
# Index tensors with any strides (issue 24, item 1): the spec accepts every layout, so each
# implementation reads what it is given or declines it, naming the tensor; dispatch then runs
# something else, and the answer is right either way. The strided views interleave the real
# entries with garbage, so a reader that assumes unit strides reads garbage.

_GARBAGE = 1 << 20


def _strided(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """A view equal to ``tensor`` whose ``dim`` has stride 2, the skipped elements garbage."""
    doubled = torch.full_like(tensor, _GARBAGE).repeat_interleave(2, dim=dim)
    index = [slice(None)] * tensor.dim()
    index[dim] = slice(0, None, 2)
    view = doubled[tuple(index)]
    view.copy_(tensor)
    return view


INDEX_VARIANTS = {
    "paged_attention": {
        "block_table_column_major": lambda kw: dict(kw, block_table=kw["block_table"].t().contiguous().t()),
        "block_table_every_other_entry": lambda kw: dict(kw, block_table=_strided(kw["block_table"])),
        "offsets_and_lengths_strided": lambda kw: dict(kw, cu_seqlens_q=_strided(kw["cu_seqlens_q"]),
                                                       seq_lens=_strided(kw["seq_lens"])),
        "sinks_strided": lambda kw: dict(kw, sinks=_strided(kw["sinks"])) if kw["sinks"] is not None else None,
    },
    "mla_decode": {
        "block_table_column_major": lambda kw: dict(kw, block_table=kw["block_table"].t().contiguous().t()),
        "block_table_every_other_entry": lambda kw: dict(kw, block_table=_strided(kw["block_table"])),
        "offsets_and_lengths_strided": lambda kw: dict(kw, cu_seqlens_q=_strided(kw["cu_seqlens_q"]),
                                                       seq_lens=_strided(kw["seq_lens"])),
    },
    "kv_cache_write": {
        "slot_mapping_strided": lambda kw: dict(kw, slot_mapping=_strided(kw["slot_mapping"])),
    },
}

# Cases each op's implementations are tried on, in order: the first one an implementation accepts
# in its contiguous form is used (the cuda kernels take only their shapes: head dim 128, fp8
# decode or Hopper prefill, MLA blocks of 64).
INDEX_CASES = {
    "paged_attention": ["small_soft_cap_sinks_window", "small_mixed_batch", "small_fp8",
                        "llama3_8b_fp8_decode_b8_ctx4096", "llama3_8b_chunked_prefill"],
    "mla_decode": ["small_mtp_fp16", "small_fp8", "deepseek_v3_h16_mtp_mixed", "partial_blocks"],
    "kv_cache_write": [c.name for c in SPECS["kv_cache_write"].cases if "random" in c.tags],
}

INDEX_PARAMS = [pytest.param(impl, variant, id=f"{impl.key}-{variant}")
                for impl in IMPLS if impl.op in INDEX_VARIANTS for variant in INDEX_VARIANTS[impl.op]]


def _accepted_case(impl, seed):
    spec = SPECS[impl.op]
    for name in INDEX_CASES[impl.op]:
        kwargs = spec.case(name).build(DEVICE, seed)
        if _interpreted(impl) and spec.cost(kwargs).bytes > INTERPRETER_MAX_BYTES // 16:
            continue
        if _answer(impl, kwargs) is None:
            return kwargs
    pytest.skip(f"{impl.key} takes none of {INDEX_CASES[impl.op]} (its shapes), strided or not")


@pytest.mark.parametrize("impl, variant", INDEX_PARAMS)
def test_index_tensors_with_any_strides(impl, variant):
    spec = SPECS[impl.op]
    seed = _fresh_seed()
    kwargs = _accepted_case(impl, seed)
    strided = INDEX_VARIANTS[impl.op][variant](kwargs)
    if strided is None:
        pytest.skip(f"{variant}: the case has no such tensor")
    ref_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    expected = spec.outputs(spec.reference(**ref_kwargs), ref_kwargs)
    reason = _answer(impl, strided)
    call = {k: v.clone() if isinstance(v, torch.Tensor) and k in spec.mutates_args else v
            for k, v in strided.items()}
    if reason is None:
        actual = spec.outputs(impl.fn(**call), call)
        what = impl.key
    else:
        changed = [name for name in strided if strided[name] is not kwargs[name]]
        assert any(name in reason for name in changed), f"{impl.key} declines without naming {changed}: {reason}"
        engine = Engine(ALL_SPECS, Settings())
        actual = spec.outputs(engine.dispatchers[impl.op](**call), call)
        what = f"dispatch after {impl.key} declined ({reason})"
    try:
        spec.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}, {variant} (seed {seed}): {error}") from None
