"""Each op is a torch custom op: opcheck passes and torch.compile(fullgraph=True) traces calls."""

from __future__ import annotations

import pytest
import torch

import kernelmux
from conftest import DEVICE
from kernelmux.ops import ALL_OPS


def _positional(spec, kwargs):
    return tuple(kwargs[name] for name in spec.signature.parameters)


# Every op's small cases (random and edge shapes): opcheck runs each several times.
SMALL_CASES = [
    pytest.param(op, case, id=f"{op.name}-{case.name}")
    for op in ALL_OPS.values()
    for case in op.spec.cases
    if {"random", "edge"} & case.tags
]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
ALL_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _has_fp8(kwargs) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dtype in FP8_DTYPES for v in kwargs.values())


@pytest.mark.parametrize("op, case", SMALL_CASES)
def test_opcheck(op, case):
    kwargs = case.build(DEVICE)
    checks = ALL_OPCHECKS
    if _has_fp8(kwargs):
        # opcheck's schema test compares the inputs before and after with torch.allclose, which
        # has no fp8 kernel on CPU or CUDA (torch 2.11-2.13); test_fp8_calls_honour_the_schema
        # checks the same contract bitwise for these cases.
        checks = tuple(c for c in ALL_OPCHECKS if c != "test_schema")
    torch.library.opcheck(op.custom_op, _positional(op.spec, kwargs), test_utils=checks)


FP8_CASES = [param for param in SMALL_CASES if _has_fp8(param.values[1].build("cpu"))]


@pytest.mark.parametrize("op, case", FP8_CASES)
def test_fp8_calls_honour_the_schema(op, case):
    """What opcheck's schema test checks, done with byte views: arguments not declared mutable
    come back bit-identical, and no output aliases an input."""
    kwargs = case.build(DEVICE)
    before = {n: v.clone() for n, v in kwargs.items() if isinstance(v, torch.Tensor)}
    result = op.custom_op(*_positional(op.spec, kwargs))
    for name, original in before.items():
        if name not in op.spec.mutates_args:
            after = kwargs[name].reshape(-1).view(torch.uint8)
            assert torch.equal(after, original.reshape(-1).view(torch.uint8)), (
                f"{op.name}: {name} changed but is not declared mutable"
            )
    outputs = result if isinstance(result, tuple) else (result,)
    inputs = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.numel()]
    for out in (o for o in outputs if isinstance(o, torch.Tensor) and o.numel()):
        assert not any(out.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for v in inputs), (
            f"{op.name}: an output aliases an input"
        )


@pytest.mark.parametrize("op, case", SMALL_CASES)
def test_custom_op_is_registered_under_kernelmux_namespace(op, case):
    assert getattr(torch.ops.kernelmux, op.name).default is op.custom_op
    kwargs, ref_kwargs = case.build(DEVICE), case.build(DEVICE)  # same seed; in-place ops mutate
    actual = op.spec.outputs(op.custom_op(*_positional(op.spec, kwargs)), kwargs)
    expected = op.spec.outputs(op.spec.reference(**ref_kwargs), ref_kwargs)
    op.spec.check_close(actual, expected, kwargs)


def test_compile_fullgraph_traces_without_graph_breaks():
    spec = kernelmux.ops.grouped_topk.spec

    def route(logits, bias):
        weights, ids = kernelmux.ops.grouped_topk(logits * 1.0, 8, True, 8, 4, "sigmoid", 2.5, bias)
        return weights * 2, ids

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    for case_name in ("deepseek_v3_t64", "deepseek_v3_t1"):
        kwargs = spec.case(case_name).build(DEVICE)
        weights, ids = compiled(kwargs["gating_output"], kwargs["e_score_correction_bias"])
        ref_w, ref_ids = spec.reference(**kwargs)
        spec.check_close((weights / 2, ids), (ref_w, ref_ids), kwargs)


def test_compile_with_inductor_backend():
    spec = kernelmux.ops.grouped_topk.spec
    compiled = torch.compile(lambda x: kernelmux.ops.grouped_topk(x, 2, True, 1, 1), fullgraph=True)
    kwargs = spec.case("mixtral_8x7b_t1024").build(DEVICE)
    spec.check_close(compiled(kwargs["gating_output"]), spec.reference(**kwargs), kwargs)


# One small random case per op: fullgraph compilation of a call through kernelmux.ops.
FIRST_RANDOM_CASE = [
    pytest.param(op, next(c for c in op.spec.cases if "random" in c.tags), id=op.name)
    for op in ALL_OPS.values()
]


@pytest.mark.parametrize("op, case", FIRST_RANDOM_CASE)
def test_every_op_compiles_fullgraph(op, case):
    # Each op is its own program: start dynamo fresh so the shared code objects (this test's
    # `call`, Op.__call__) do not hit the recompile limit across parameters.
    torch._dynamo.reset()
    kwargs, ref_kwargs = case.build(DEVICE), case.build(DEVICE)
    names = list(op.spec.signature.parameters)

    def call(*args):
        return op(*args)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    actual = op.spec.outputs(compiled(*(kwargs[n] for n in names)), kwargs)
    expected = op.spec.outputs(op.spec.reference(**ref_kwargs), ref_kwargs)
    op.spec.check_close(actual, expected, kwargs)
