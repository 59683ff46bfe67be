"""Shared by the cuda backend's kernel tests: skip marks naming what a test needs, and NaN-poisoned
allocator blocks so an output element a kernel never writes fails the comparison."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from kernelmux.backends.cuda import _nvrtc

HOPPER = (9, 0)

needs_gpu = pytest.mark.skipif(DEVICE != "cuda",
                               reason="runs CUDA kernels: needs an NVIDIA GPU; runs in the GPU suite")
needs_hopper = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() != HOPPER,
    reason="runs the sm_90a (wgmma) kernel: needs an H100/H200; runs in the GPU suite")
needs_nvrtc = pytest.mark.skipif(_nvrtc.find_nvrtc() is None,
                                 reason="NVRTC not installed (pip install nvidia-cuda-nvrtc; the test extra "
                                        "has it)")


def poison_allocator(nbytes: int) -> None:
    """NaN-filled blocks left in the allocator's free lists: outputs a kernel allocates start as
    NaN, so an element it never writes fails the comparison."""
    blocks = [torch.full((nbytes // 4 + extra,), float("nan"), device=DEVICE) for extra in (0, 64, 4096)]
    del blocks
