"""The fake aiter (tests/vendors/aiter) installed as amd-aiter at the version of the source it models,
on a simulated gfx942 or gfx950 (its dtypes.fp8 and kernel tables follow the arch)."""

from __future__ import annotations

import importlib

import pytest

from kernelmux.backends.aiter import AITER
from vendors import FAKES, install_fake

VERSION = FAKES["aiter"][1]
GFX_ENV = "FAKE_AITER_GFX"  # the fake's chip_info reads it


@pytest.fixture
def install_aiter(monkeypatch, tmp_path):
    """``install_aiter(gfx="gfx942", version=VERSION, files=None)``: the fake (or ``files``) installed as
    amd-aiter ``version`` for a machine of ``gfx``; the aiter module is imported by the first use."""
    count = iter(range(1000))

    def install(gfx="gfx942", version=VERSION, files=None):
        monkeypatch.setenv(GFX_ENV, gfx)
        return install_fake(monkeypatch, tmp_path / f"install{next(count)}", "aiter", "amd-aiter", version, files)

    return install


def _installed(install, gfx):
    install(gfx)
    assert AITER.problem() is None
    return importlib.import_module("aiter")


@pytest.fixture
def gfx942(install_aiter):
    """The fake aiter of an MI300 (fp8 = e4m3fnuz)."""
    return _installed(install_aiter, "gfx942")


@pytest.fixture
def gfx950(install_aiter):
    """The fake aiter of an MI355 (fp8 = e4m3fn, FP4 GEMM)."""
    return _installed(install_aiter, "gfx950")
