"""The fake vllm-xpu-kernels for the xpu backend's tests: installed as the real distribution at the version its
source was read at, and its torch ops (torch.ops._C, _moe_C, _xpu_C, _vllm_fa2_C) removed again after every
test, so no namespace outlives the test that defined it."""

from __future__ import annotations

import sys

import pytest

from vendors import FAKES, install_fake

VERSION = FAKES["vllm_xpu_kernels"][1]
_HOLDER = "_fake_vllm_xpu_kernels_libraries"  # tests/vendors/vllm_xpu_kernels/_library.py keeps its libraries here


@pytest.fixture(autouse=True)
def _unload_fake_ops():
    yield
    holder = sys.modules.get(_HOLDER)
    if holder is not None:
        while holder.libraries:
            holder.libraries.popitem()[1]._destroy()


@pytest.fixture
def install_xpu(monkeypatch, tmp_path):
    """``install_xpu(version=VERSION, files=None)``: the fake (or ``files`` instead of its sources)
    installed as vllm-xpu-kernels ``version`` for this test."""
    def install(version=VERSION, files=None):
        return install_fake(monkeypatch, tmp_path, "vllm_xpu_kernels", "vllm-xpu-kernels", version, files)

    return install


@pytest.fixture
def vendor(install_xpu):
    """The fake installed and accepted by the vendor mechanism; its extension modules imported."""
    from kernelmux.backends.xpu import XPU_KERNELS

    install_xpu()
    assert XPU_KERNELS.problem() is None
    import vllm_xpu_kernels._C
    import vllm_xpu_kernels._moe_C
    import vllm_xpu_kernels._vllm_fa2_C
    import vllm_xpu_kernels._xpu_C
    import vllm_xpu_kernels.flash_attn_interface

    return {name: sys.modules[f"vllm_xpu_kernels.{name}"]
            for name in ("_C", "_moe_C", "_xpu_C", "_vllm_fa2_C", "flash_attn_interface")}
