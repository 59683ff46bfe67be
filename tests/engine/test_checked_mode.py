"""Checked mode (KERNELMUX_CHECK=1, configure(check=True)): index data validated with one device
pass before any implementation runs, outputs compared with the spec's fake after it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernelmux
from conftest import DEVICE
from fakes import Counter, FakePlugin, fake_impl
from kernelmux.engine import CheckedDispatcher, Dispatcher, Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.errors import DeviceDataError, ImplementationError
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import grouped_topk as grouped_topk_spec
from kernelmux.specs import kv_cache_write as kv_spec
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.registry import Implementation, Registry

CHECKED = Settings(check=True)
SPECS = {spec.name: spec for spec in ALL_SPECS}


def _engine(*impls, settings=CHECKED) -> Engine:
    registry = Registry(SPECS)
    registry.register_plugin(FakePlugin(*impls), "fakes")
    return Engine(ALL_SPECS, settings, platform=simulate("x86_64"), registry=registry)


def _counting(spec, backend: str, counter: Counter, result=None) -> Implementation:
    """An implementation of ``spec`` that counts its calls and returns ``result(kwargs)`` (default:
    the reference's outputs)."""
    def fn(*args, **kwargs):
        counter.calls += 1
        bound = spec.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return result(bound.arguments) if result is not None else spec.reference(*args, **kwargs)

    fn.__signature__ = spec.signature
    return Implementation(op=spec.name, backend=backend, fn=fn, spec_version=spec.version, priority=50)


def test_settings_select_the_checked_dispatcher():
    assert Settings.from_env({"KERNELMUX_CHECK": "1"}).check
    assert isinstance(_engine().dispatchers["paged_attention"], CheckedDispatcher)
    assert type(_engine(settings=Settings()).dispatchers["paged_attention"]) is Dispatcher
    try:
        engine = kernelmux.configure(check=True, from_env=False)
        assert isinstance(engine.dispatchers["grouped_topk"], CheckedDispatcher)
        assert kernelmux.report()["settings"]["check"] is True
    finally:
        kernelmux.reset()


@pytest.mark.parametrize("spec", [pa_spec.SPEC, mla_spec.SPEC, kv_spec.SPEC], ids=lambda s: s.name)
def test_every_named_case_passes_the_data_check(spec):
    for case in spec.cases:
        if "gpu" in case.tags:
            continue  # GB-sized: the same builders as the model cases
        spec.check_data(**case.build(seed=3))


def _paged(**changes):
    kwargs = pa_spec.SPEC.case("small_mixed_batch").build(seed=1)  # q_lens 3 1 9 0 5, block size 8
    kwargs.update(changes)
    return kwargs


def _bad_paged_calls():
    good = _paged()
    table, cu, lens = good["block_table"], good["cu_seqlens_q"], good["seq_lens"]
    num_blocks = good["k_cache"].shape[0]
    past_cache = table.clone()
    past_cache[2, 1] = num_blocks  # sequence 2 (9 positions, 2 blocks) reads its entry 1
    unread = table.clone()
    unread[2, 3] = num_blocks + 7  # beyond what sequence 2 reads: allowed
    too_many = cu.clone()
    too_many[-1] += 1
    decreasing = cu.clone()
    decreasing[2] = decreasing[1] - 1
    short = lens.clone()
    short[4] = 2  # 5 queries over 2 positions (causal)
    return [
        (dict(block_table=past_cache), "block_table", f"block_table[2, 1] = {num_blocks}"),
        (dict(cu_seqlens_q=too_many), "cu_seqlens_q", f"cu_seqlens_q[5] = {int(cu[-1]) + 1}"),
        (dict(cu_seqlens_q=decreasing), "cu_seqlens_q", "nondecreasing"),
        (dict(max_query_len=5), "cu_seqlens_q", "9 queries in sequence 2"),
        (dict(seq_lens=short), "seq_lens", "seq_lens[4] = 2 with 5 queries"),
        (dict(max_seq_len=20), "seq_lens", "seq_lens[4] = 21"),
        (dict(block_table=table[:, :2]), "block_table", "sequence 4 of length 21 needs 3 blocks"),
        (dict(block_table=unread), None, None),
    ]


@pytest.mark.parametrize("changes, argument, fragment", _bad_paged_calls())
def test_index_data_out_of_range_is_an_error_before_anything_runs(changes, argument, fragment):
    counter = Counter()
    engine = _engine(_counting(pa_spec.SPEC, "counting", counter))
    kwargs = _paged(**changes)
    if argument is None:
        engine.dispatchers["paged_attention"](**kwargs)
        assert counter.calls == 1
        return
    with pytest.raises(DeviceDataError) as info:
        engine.dispatchers["paged_attention"](**kwargs)
    assert info.value.argument == argument and fragment in str(info.value)
    assert counter.calls == 0


def test_slot_mapping_past_the_cache_is_an_error():
    kwargs = kv_spec.SPEC.case("small_fp16_padding").build(seed=2)
    capacity = kwargs["k_cache"].shape[0] * kwargs["k_cache"].shape[1]
    slots = kwargs["slot_mapping"].clone()
    slots[0] = capacity
    counter = Counter()
    engine = _engine(_counting(kv_spec.SPEC, "counting", counter))
    with pytest.raises(DeviceDataError, match=rf"slot_mapping.*slot_mapping\[0\] = {capacity}"):
        engine.dispatchers["kv_cache_write"](**dict(kwargs, slot_mapping=slots))
    assert counter.calls == 0
    engine.dispatchers["kv_cache_write"](**kwargs)  # negative slots are padding: fine
    assert counter.calls == 1


def test_mla_block_table_past_the_cache_is_an_error():
    kwargs = mla_spec.SPEC.case(next(c.name for c in mla_spec.SPEC.cases if "random" in c.tags)).build(seed=5)
    table = kwargs["block_table"].clone()
    table[0, 0] = -1
    with pytest.raises(DeviceDataError, match=r"block_table\[0, 0\] = -1"):
        mla_spec.SPEC.check_data(**dict(kwargs, block_table=table))


def test_the_data_check_runs_on_the_inputs_device():
    """One device pass: the rules are torch ops on the inputs' device, read back once."""
    kwargs = pa_spec.SPEC.case("small_mixed_batch").build(DEVICE, seed=1)
    pa_spec.SPEC.check_data(**kwargs)
    table = kwargs["block_table"].clone()
    table[0, 0] = 10_000
    with pytest.raises(DeviceDataError, match="block_table"):
        pa_spec.SPEC.check_data(**dict(kwargs, block_table=table))


@pytest.mark.parametrize("result, fragment", [
    (lambda a: (a["gating_output"].new_zeros(a["gating_output"].shape[0], a["topk"]),) * 2,
     "returned output[1] of shape"),  # int ids returned as fp32
    (lambda a: (torch.zeros(a["gating_output"].shape[0], a["topk"] + 1),
                torch.zeros(a["gating_output"].shape[0], a["topk"], dtype=torch.int32)),
     "returned output[0] of shape"),
    (lambda a: torch.zeros(1), "returned a Tensor as output, the spec returns a tuple of 2"),
])
def test_outputs_that_break_the_spec_are_named_in_checked_mode(result, fragment):
    spec = grouped_topk_spec.SPEC
    counter = Counter()
    engine = _engine(_counting(spec, "sloppy", counter, result))
    kwargs = spec.case("small_softmax").build()
    with pytest.raises(ImplementationError) as info:
        engine.dispatchers["grouped_topk"](**kwargs)
    assert info.value.backend == "sloppy" and info.value.plugin == "fakes"
    assert fragment in str(info.value)
    # Unchecked, the same implementation is served as is: checking costs a fake per call.
    unchecked = _engine(_counting(spec, "sloppy", counter, result), settings=Settings())
    unchecked.dispatchers["grouped_topk"](**kwargs)


def test_conforming_outputs_pass_checked_mode():
    counter = Counter()
    engine = _engine(dataclasses.replace(fake_impl("good", counter), priority=50))
    kwargs = grouped_topk_spec.SPEC.case("small_softmax").build()
    out = engine.dispatchers["grouped_topk"](**kwargs)
    grouped_topk_spec.SPEC.check_close(out, grouped_topk_spec.SPEC.reference(**kwargs), kwargs)
    assert counter.calls == 1
