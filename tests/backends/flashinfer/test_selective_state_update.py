"""The flashinfer backend's selective_state_update against a fake flashinfer.mamba that holds the shipped
signature, checks and arithmetic (tests/vendors/flashinfer/mamba): the adapter's y and state against the
spec's reference, its declines, keyword calls, the first-call log and registration. On a GPU with
flashinfer installed, tests/backends/test_conformance.py runs the real kernel against the reference."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from fakes import ask
from kernelmux.backends import _vendor
from kernelmux.backends.flashinfer import CALLS, FLASHINFER
from kernelmux.backends.flashinfer import selective_state_update as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import selective_state_update as spec
from vendors import install_fake, sources

CASES = {case.name: case for case in spec.SPEC.cases}


def _install(monkeypatch, tmp_path, files=None):
    return install_fake(monkeypatch, tmp_path, "flashinfer", "flashinfer-python", "0.6.14", files)


@pytest.fixture
def vendor(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path)
    assert FLASHINFER.problem() is None
    import flashinfer.mamba

    return flashinfer.mamba


def _kwargs(name, seed=0):
    return CASES[name].make(torch.device("cpu"), torch.Generator().manual_seed(seed))


def _run_both(kwargs):
    expected_state = kwargs["state"].clone()
    expected = spec.SPEC.reference(**{**kwargs, "state": expected_state})
    actual = adapter.selective_state_update(**kwargs)
    spec.SPEC.check_close((actual, kwargs["state"]), (expected, expected_state), kwargs)


# The spec's cases the kernel serves (N in 32..256): Mamba2-2.7B shapes, padded and bf16 caches.
SERVED = ["mamba2_2.7b_b1", "mamba2_2.7b_b8", "mamba2_2.7b_b64_padded", "mamba2_2.7b_b8_bf16_state"]


@pytest.mark.parametrize("name", SERVED)
def test_adapter_matches_the_reference_on_the_spec_cases(vendor, name):
    kwargs = _kwargs(name)
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90")) is None
    _run_both(kwargs)
    assert vendor.CALLS[-1]["algorithm"] == "auto"  # P = 64


def _small(requests=5, heads=4, head_dim=64, groups=2, state_dim=32, slots=9, padding=2, seed=0,
           dtype=torch.bfloat16, state_dtype=torch.float32, **options):
    make = spec._maker(requests, heads, head_dim, groups, state_dim, dtype, state_dtype, slots=slots,
                       padding=padding, **options)
    return make(torch.device("cpu"), torch.Generator().manual_seed(seed))


def test_padding_rows_are_zero_though_the_kernel_writes_them(vendor):
    # The kernel computes a padding request's y from a zero state (D * x, gated); the spec's is 0.
    kwargs = _small(padding=3, head_dim=192)
    _run_both(kwargs)
    assert vendor.CALLS[-1]["algorithm"] == "simple"  # P = 192: not a vertical/horizontal head dim


def test_any_negative_index_is_padding(vendor):
    # The kernel skips only slot == pad_slot_id (-1); the fake, like the kernel, faults on -7.
    kwargs = _small(padding=0)
    kwargs["state_batch_indices"][[1, 3]] = torch.tensor([-7, -2], dtype=torch.int32)
    _run_both(kwargs)


def test_mixed_parameter_dtypes_go_up_to_fp32_and_D_none_is_zero(vendor):
    kwargs = _small(with_d=False, param_dtype=torch.float16, dtype=torch.float16)
    kwargs["dt"] = kwargs["dt"].bfloat16()  # dt bf16, dt_bias fp16: the kernel reads one dtype
    _run_both(kwargs)
    assert vendor.CALLS[-1]["weight_dtype"] == torch.float32


def test_more_requests_than_slots_runs_in_chunks(vendor):
    # Legal in the spec (padding requests own no slot), refused by the kernel (state.size(0) >= batch).
    kwargs = _small(requests=7, slots=9, padding=3)
    indices = kwargs["state_batch_indices"]
    live = indices >= 0
    indices[live] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # 4 live requests own the 4 slots
    kwargs["state"] = kwargs["state"][:4].clone().normal_()
    _run_both(kwargs)
    assert [call["batch"] for call in vendor.CALLS[-2:]] == [4, 3]


def test_strided_inputs_and_a_cache_view(vendor, caplog, monkeypatch):
    monkeypatch.setattr(adapter, "_warned_state_copy", False)
    kwargs = _small(requests=4, heads=4, head_dim=64, groups=1, state_dim=64, slots=6, padding=1)
    x = kwargs["x"]
    kwargs["x"] = torch.cat([x, x], dim=2)[:, :, ::2]  # non-unit stride along P
    kwargs["dt"] = torch.cat([kwargs["dt"], kwargs["dt"]], dim=1)[:, ::2]
    kwargs["A"] = torch.stack([kwargs["A"], kwargs["A"]], dim=1)[:, 0]
    wide = torch.full((6, 4, 64, 128), float("nan"))
    wide[..., :64] = kwargs["state"]
    kwargs["state"] = wide[..., :64]  # dense 16-byte rows, but not the packed [P, N] the kernel indexes
    with caplog.at_level(logging.WARNING, logger=adapter.__name__):
        _run_both(kwargs)
    assert "running on a packed copy" in caplog.text
    assert torch.isnan(wide[..., 64:]).all()  # the copy back wrote the view only


def test_empty_and_all_padding(vendor):
    _run_both(_small(requests=4, slots=6, padding=4))  # every request padding
    kwargs = _small(requests=3, slots=3, padding=3)
    kwargs["state"] = kwargs["state"][:0]  # and a cache of no slots: never called
    _run_both(kwargs)
    kwargs = _small(requests=0, slots=3)
    assert adapter.selective_state_update(**kwargs).shape == kwargs["x"].shape
    assert all(call["batch"] for call in vendor.CALLS)  # an empty batch never reaches the vendor


@pytest.mark.parametrize("case, platform, reason", [
    ("small_permuted", "sm_90", "state dim N = 16"),
    ("mamba2_2.7b_b1", "sm_75", "not sm_75"),
])
def test_supports_declines_by_name(case, platform, reason):
    assert reason in ask(adapter.supports, spec.SPEC, _kwargs(case), simulate(platform))


def test_declines_misaligned_state_rows_and_head_dims_the_module_cannot_build():
    kwargs = _small(state_dim=32)
    shape = kwargs["state"].shape
    kwargs["state"] = torch.zeros(kwargs["state"].numel() + 1)[1:].view(shape)  # 4 bytes off
    assert "16-byte aligned" in ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90"))
    for head_dim in (3, 16, 48, 80, 96):  # on the H200 16, 48, 80 and 96 failed to compile; 64 and 192 built
        kwargs = _small(heads=3, head_dim=head_dim, groups=1, dtype=torch.float16)
        assert f"head dim P = {head_dim}" in ask(adapter.supports, spec.SPEC, kwargs, simulate("sm_90"))
    for head_dim in (64, 192):
        assert ask(adapter.supports, spec.SPEC, _small(head_dim=head_dim), simulate("sm_90")) is None


def test_the_vendor_is_called_by_keyword(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    shipped = fake["flashinfer/mamba/__init__.py"]
    reordered = shipped.replace(
        "def selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=None, dt_softplus=False,",
        "def selective_state_update(C, B, A, dt, x, state, D, z=None, dt_bias=None, dt_softplus=False,")
    assert reordered != shipped
    _install(monkeypatch, tmp_path, {**fake, "flashinfer/mamba/__init__.py": reordered})
    _run_both(_kwargs("mamba2_2.7b_b8"))


def test_a_vendor_without_the_keywords_is_quarantined(monkeypatch, tmp_path):
    fake = sources("flashinfer")
    old = "def selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=None, dt_softplus=False,\n"
    assert old in fake["flashinfer/mamba/__init__.py"]
    _install(monkeypatch, tmp_path, {**fake, "flashinfer/mamba/__init__.py":
                                     "def selective_state_update(state, x, dt, A, B, C, D, z=None):\n    pass\n"})
    reason = "selective_state_update takes no keyword dt_bias, dt_softplus, state_batch_indices, pad_slot_id"
    assert reason in FLASHINFER.problem_for(CALLS["selective_state_update"])
    rejected = {impl.backend: why for impl, why in
                Engine(ALL_SPECS, Settings(platform="sm_90")).tables[spec.NAME].rejected}
    assert reason in rejected["flashinfer"]


def test_registered_through_the_entry_point(vendor):
    engine = Engine(ALL_SPECS, Settings(platform="sm_90"))
    [impl] = [c.impl for c in engine.tables[spec.NAME].candidates if c.impl.backend == "flashinfer"]
    assert impl.description.startswith("flashinfer-python 0.6.14: flashinfer.mamba.selective_state_update")


def test_the_first_call_is_logged_before_it_runs_and_timed(vendor, caplog, monkeypatch):
    monkeypatch.setattr(_vendor, "first_calls", _vendor._FirstCalls())
    monkeypatch.setattr(adapter, "first_calls", _vendor.first_calls)
    kwargs = _small()
    with caplog.at_level(logging.WARNING, logger="kernelmux.vendor"):
        adapter.selective_state_update(**kwargs)
        adapter.selective_state_update(**kwargs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "may compile" in messages[0] and "took" in messages[1]
    assert list(_vendor.first_calls.seconds()) == [
        ("flashinfer", spec.NAME, (torch.float32, torch.bfloat16, torch.float32, 64, 32))]


def test_fake_is_imported_from_the_installed_distribution(vendor):
    assert "tests/vendors" not in sys.modules["flashinfer.mamba"].__file__
