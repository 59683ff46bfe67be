"""perf/records.py: the provenance every record carries (the commit, the device, the versions)."""

from __future__ import annotations

import re

import pytest
import torch

from kernelmux.perf import records


def test_commit_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("KERNELMUX_COMMIT", "abc1234+experiment")
    assert records.commit() == "abc1234+experiment"


def test_commit_falls_back_to_the_checkout(monkeypatch):
    monkeypatch.delenv("KERNELMUX_COMMIT", raising=False)
    # A git checkout (the repo, CI's clone) gives its short HEAD; an installed copy without git, "unknown".
    assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", records.commit())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="names a CUDA device (run on the GPU)")
def test_header_names_device_versions_and_commit(monkeypatch):
    monkeypatch.setenv("KERNELMUX_COMMIT", "feedbee")
    header = records.header()
    assert header["device"] == torch.cuda.get_device_name() and header["torch"] == torch.__version__
    assert header["commit"] == "feedbee" and header["timestamp"].endswith("+00:00")
    assert set(header) == {"device", "torch", "triton", "commit", "timestamp"}
