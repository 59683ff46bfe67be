"""backends/triton/_attention.py, the plans paged_attention and mla_decode share: the table a GPU
gets, split counts and the large prefill plan from host ints only, overrides, and plans that do
not fit stepping down."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import DEVICE
from graph_replay import build
from kernelmux.backends.triton import _attention
from kernelmux.backends.triton.paged_attention import paged_attention
from kernelmux.specs import paged_attention as pa_spec

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


@pytest.mark.parametrize("capability, table", [
    ((9, 0), "_TABLE"), ((10, 0), "_TABLE"), ((8, 0), "_COMPACT_TABLE"), ((8, 9), "_COMPACT_TABLE"),
    ((12, 0), "_COMPACT_TABLE"),
])
def test_plan_table_follows_shared_memory(monkeypatch, capability, table):
    monkeypatch.setattr(_attention, "_capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    for kind, plan in getattr(_attention, table).items():
        assert _attention._base_plan(kind, torch.device("cuda")) == plan
    assert _attention._base_plan("prefill", torch.device("cpu")) == _attention._TABLE["prefill"]
    # ROCm: gfx942 reports (9, 4) but has 64 KB of LDS; Intel GPUs: 64-128 KB.
    assert _attention._base_plan("mla", torch.device("xpu")) == _attention._COMPACT_TABLE["mla"]
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert _attention._base_plan("mla", torch.device("cuda")) == _attention._COMPACT_TABLE["mla"]


def test_an_xpu_plan_asks_no_cuda_capability(monkeypatch):
    # torch.cuda.get_device_capability raises for an XPU device: launches there must not ask it.
    def cuda_only(device):
        raise AssertionError(f"asked the CUDA capability of {device}")

    monkeypatch.setattr(_attention, "_capability", cuda_only)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _attention._base_plan("decode", torch.device("xpu")) == _attention._COMPACT_TABLE["decode"]


def test_plan_uses_host_ints_only_and_splits_small_grids():
    device = torch.device(DEVICE)
    sms = _attention._sm_count(device)
    # Many sequences: the grid already fills the device, no split.
    many = _attention.plan_for("decode", device, 64 * sms, 64 * sms, 4, 8, 1, 4096, head_dim=128)
    assert many.num_splits == 1
    # One long sequence, one KV head: split up to the per-SM target, bounded by the length.
    one = _attention.plan_for("decode", device, 1, 1, 8, 1, 1, 32768, head_dim=128)
    assert 1 < one.num_splits <= _attention._MAX_SPLITS
    short = _attention.plan_for("decode", device, 1, 1, 8, 1, 1, _attention._MIN_SPLIT_LEN, head_dim=128)
    assert short.num_splits == 1
    with _attention.override_plan(num_splits=3, block_n=16):
        forced = _attention.plan_for("decode", device, 1, 1, 8, 1, 1, 100, head_dim=128)
    assert (forced.num_splits, forced.block_n) == (3, 16)
    with pytest.raises(ValueError, match="unknown AttentionPlan fields"):
        with _attention.override_plan(block_k=3):
            pass


@pytest.mark.parametrize("kind, seqs, group, kv_heads, seq_len, splits", [
    ("decode", 64, 4, 8, 4096, 1),  # Llama-3-8B B64: 512 programs already fill 132 SMs
    ("decode", 64, 8, 1, 4096, 4),  # Llama-3-70B TP8 B64: 256 of 264 slots, one wave (8: two, no faster)
    ("decode_fp8", 8, 8, 1, 32768, 32),  # B8 x 32768: 8 programs x 32 splits, one wave
    ("decode", 8, 8, 1, 1024, 2),  # bounded by the length: 1024 / 512
    ("mla", 64, 128, 1, 4096, 1),  # 128 programs of 64 heads fill 128 of 132 SMs; 2 splits: 2 waves
    ("mla", 128, 128, 1, 4096, 1),
    ("mla", 8, 128, 1, 4096, 8),  # 16 programs: 8 splits fill one wave (16 would take two)
    ("decode", 40, 8, 1, 4096, 4),  # 40 programs: 4 splits (160 of 264 slots) as fast as 8 (two waves)
    ("mla", 100, 128, 1, 4096, 1),  # 200 programs in 2 waves are no faster than 100 in one
])
def test_split_counts_on_an_h100_grid(monkeypatch, kind, seqs, group, kv_heads, seq_len, splits):
    monkeypatch.setattr(_attention, "_sm_count", lambda device: 132)
    plan = _attention.plan_for(kind, torch.device("cpu"), seqs, seqs, group, kv_heads, 1, seq_len,
                              head_dim=128)
    assert plan.num_splits == splits


@pytest.mark.parametrize("tokens, head_dim, large", [
    (8192, 128, True),  # 257 tiles x 8 KV heads = 15.6 waves of one program per SM
    (1024, 128, False),  # 2 waves
    (8192, 256, False),  # the large tile does not fit shared memory at head dim 256
])
def test_large_prefill_plan_for_long_prefills(monkeypatch, tokens, head_dim, large):
    monkeypatch.setattr(_attention, "_sm_count", lambda device: 132)
    plan = _attention.plan_for("prefill", torch.device("cpu"), 1, tokens, 4, 8, tokens, tokens,
                              head_dim=head_dim)
    kind = "prefill_large" if large else "prefill"
    assert plan == _attention._TABLE[kind]  # a grid of a wave or more never splits


def test_plans_that_do_not_fit_step_down(monkeypatch):
    # A GPU that cannot hold KV steps past 32 positions (Triton raises OutOfResources when the
    # kernel is loaded): the call still matches the reference, on the first smaller plan that
    # runs, and later calls go to that plan directly.
    from triton.runtime.errors import OutOfResources

    real_launch = _attention._launch
    tried = []

    def small_gpu_launch(*, plan, **args):
        tried.append(plan)
        if plan.block_n > 32:
            raise OutOfResources(300_000, 232_448, "shared memory")
        real_launch(plan=plan, **args)

    monkeypatch.setattr(_attention, "_launch", small_gpu_launch)
    monkeypatch.setattr(_attention, "_FITTED", {})
    # A chunked prefill, a decode, a full prefill and a sequence without queries.
    kwargs = build(pa_spec._maker((5, 1, 9, 0), (23, 17, 9, 6), 8, 2, 32, block_size=8), 11, DEVICE)
    with _attention.override_plan(block_n=128, num_splits=1):
        pa_spec.SPEC.check_close(paged_attention(**kwargs), pa_spec.SPEC.reference(**kwargs), kwargs)
        assert [p.block_n for p in tried] == [128, 64, 32]
        tried.clear()
        pa_spec.SPEC.check_close(paged_attention(**kwargs), pa_spec.SPEC.reference(**kwargs), kwargs)
        assert [p.block_n for p in tried] == [32]
    smallest = _attention.AttentionPlan(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert _attention._smaller(smallest) is None
