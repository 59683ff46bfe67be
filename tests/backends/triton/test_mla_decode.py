"""The triton backend's mla_decode beyond the named cases: every launch-plan shape, the compact
plans, queries past fp16's range over fp8 caches, grids past CUDA's axis limit, and CUDA-graph
replays with changed inputs (GPU only)."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

from conftest import DEVICE
from fakes import ask
from graph_replay import build, capture, replay_on_new_inputs
from kernelmux.backends.triton import _attention
from kernelmux.backends.triton.mla_decode import mla_decode, supports
from kernelmux.platforms import simulate
from kernelmux.registry import signature_difference
from kernelmux.specs import mla_decode as mla_spec

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def _build(make, seed: int) -> dict:
    return build(make, seed, DEVICE)


def _check_mla(kwargs, seed):
    """mla_decode against the spec's reference, the seed named on a mismatch."""
    expected = mla_spec.SPEC.reference(**kwargs)
    actual = mla_decode(**kwargs)
    try:
        mla_spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def test_signatures_match_the_spec():
    assert signature_difference(mla_spec.SPEC.signature, mla_decode) is None
    assert list(inspect.signature(supports).parameters) == ["key", "platform"]


@pytest.mark.parametrize("kind", sorted(k for k in _attention._COMPACT_TABLE if k.startswith("mla")))
def test_compact_table_plans(kind):
    # The plans for GPUs with 99 KB of shared memory, on an MTP batch.
    plan = dataclasses.asdict(_attention._COMPACT_TABLE[kind])
    case = "small_fp8" if kind == "mla_fp8" else "small_mtp_fp16"
    kwargs = mla_spec.SPEC.case(case).build(DEVICE, 7)
    with _attention.override_plan(**plan):
        _check_mla(kwargs, 7)


def test_fp8_cache_queries_past_fp16_range():
    # fp8 caches run the dots in fp16 (max 65504): bf16 queries up to 3e5 must still match the
    # reference, so the kernel scales such a tile by a power of two. The softmax scale shrinks by
    # the same factor so the scores stay in the usual range.
    kwargs = mla_spec.SPEC.case("small_fp8").build(DEVICE, 11)
    kwargs["scale"] = kwargs["scale"] * 1e-5
    kwargs["q"] = (kwargs["q"].float() * 1e5).to(kwargs["q"].dtype)
    assert kwargs["q"].abs().max() > 65504
    for splits in (1, 2):
        with _attention.override_plan(num_splits=splits):
            _check_mla(kwargs, 11)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (64, 32), (32, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", ["small_mtp_fp16", "small_fp8", "partial_blocks", "nan_in_unused_slots"])
def test_mla_decode_every_plan_shape(case, block_m, block_n, num_splits):
    seed = 1000 * block_m + block_n + num_splits
    kwargs = mla_spec.SPEC.case(case).build(DEVICE, seed)
    with _attention.override_plan(block_m=block_m, block_n=block_n, num_splits=num_splits):
        _check_mla(kwargs, seed)


@pytest.mark.parametrize("num_seqs, refused", [(65535, False), (65536, True)])
def test_supports_refuses_grids_past_cudas_axis_limit(num_seqs, refused):
    # supports reads the key only: meta tensors stand in for a 65536-sequence MLA decode batch
    # on an H100 (one query per sequence: one tile each).
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")
    kwargs = dict(q=meta(num_seqs, 16, 576), kv_cache=meta(8, 64, 576),
                  cu_seqlens_q=meta(num_seqs + 1, dtype=torch.int32), block_table=meta(num_seqs, 1, dtype=torch.int32),
                  seq_lens=meta(num_seqs, dtype=torch.int32), max_query_len=1, max_seq_len=64, scale=0.1)
    reason = ask(supports, mla_spec.SPEC, kwargs, simulate("sm_90"))
    assert (reason is not None) == refused
    if refused:
        assert "up to 131071 query tiles (this batch's size class) > 65535" in reason


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the plan depends on host ints only, so a captured decode replays correctly on
# new lengths, block tables and queries (within the max_seq_len of the capture).

needs_cuda = pytest.mark.skipif(DEVICE != "cuda",
                                reason="CUDA graphs need a CUDA device; runs in the GPU suite")


@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_decode_graph_replays_new_inputs(num_splits):
    batch, max_len = 8, 1024
    make = mla_spec._maker((1,) * batch, (max_len,) * batch, 128, scale=mla_spec.DEEPSEEK_V3_SCALE,
                           spare_blocks=16)
    static = _build(make, 0)
    plan = {} if num_splits is None else {"num_splits": num_splits}
    with _attention.override_plan(**plan):
        graph, (out, lse) = capture(mla_decode, static)
        replay_on_new_inputs(mla_spec, make, static, graph, (out, lse), batch, max_len)
