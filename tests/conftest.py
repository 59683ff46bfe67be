"""Test-session setup: the device under test, the Triton interpreter on CPU-only machines, and
hypothesis profiles."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run on the CPU under its interpreter when there is no GPU. Triton reads this when
# a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Selection in tests follows priorities: a shipped or user tuning table that happens to match the
# machine running them would otherwise reorder candidates by timings of another session. Processes
# the tests start read this; in this one, _no_tuning_tables hides the tables (the tuning tests give
# their own: tests/engine/test_tuning.py).
os.environ.setdefault("KERNELMUX_TUNING", "0")

settings.register_profile(
    "default", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _no_tuning_tables(monkeypatch, tmp_path_factory):
    from kernelmux.engine import tuning

    empty = tmp_path_factory.getbasetemp() / "no-tuning-tables"
    monkeypatch.setattr(tuning, "shipped_dir", lambda: empty)
    monkeypatch.setattr(tuning, "user_dir", lambda: empty)
