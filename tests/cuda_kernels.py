"""Shared by the cuda backend's kernel tests: skip marks naming what a test needs, NaN-poisoned
allocator blocks so an output element a kernel never writes fails the comparison, the backend's
paged_attention checked against the spec's reference, and a cubin's SASS per kernel (cuobjdump,
which Triton's wheel bundles) for tests of what ptxas emitted."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

from conftest import DEVICE
from fakes import ask
from kernelmux.backends.cuda import _toolchain
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.conformance import poison_freed_memory
from kernelmux.specs import paged_attention as pa_spec

HOPPER = (9, 0)

needs_gpu = pytest.mark.skipif(DEVICE != "cuda",
                               reason="runs CUDA kernels: needs an NVIDIA GPU; runs in the GPU suite")
needs_hopper = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() != HOPPER,
    reason="runs a kernel built for Hopper (sm_90): needs an H100/H200; runs in the GPU suite")
def _find_cuobjdump() -> str | None:
    try:
        import triton.backends.nvidia as nvidia_backend
    except ImportError:
        return shutil.which("cuobjdump")
    bundled = pathlib.Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


CUOBJDUMP = _find_cuobjdump()
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (Triton's Linux wheel "
                                                               "bundles it; the test extra has Triton)")


def sass(cubin: bytes) -> dict[str, list[str]]:
    """Each kernel's SASS instructions in a cubin, in order, by mangled name."""
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "module.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([CUOBJDUMP, "-sass", str(path)], check=True, capture_output=True,
                                 text=True).stdout
    kernels: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        function = re.match(r"\s*Function : (\S+)", line)
        if function:
            current = kernels.setdefault(function.group(1), [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if instruction:
            current.append(instruction.group(1))
    return kernels


needs_nvrtc = pytest.mark.skipif(_toolchain.find_nvrtc() is None,
                                 reason="NVRTC not installed (pip install nvidia-cuda-nvrtc; the test extra "
                                        "has it)")


def poison_allocator(nbytes: int) -> None:
    """NaN-filled blocks left in the allocator's free lists: outputs a kernel allocates start as
    NaN, so an element it never writes fails the comparison."""
    poison_freed_memory(DEVICE, nbytes)


def check_paged_attention(kwargs: dict, seed: int, poison: bool = False) -> None:
    """The cuda backend takes the call and matches the spec's reference; ``poison`` fills fresh
    allocator blocks with NaN first, so output the kernel never writes fails. ``seed`` names the
    inputs in the failure."""
    assert ask(cuda_paged_attention.supports, pa_spec.SPEC, kwargs) is None
    expected = pa_spec.SPEC.reference(**kwargs)
    if poison:
        poison_allocator(kwargs["query"].numel() * 2)
    actual = cuda_paged_attention.paged_attention(**kwargs)
    try:
        pa_spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def finite_bf16_values(seed: int, width: int) -> torch.Tensor:
    """Every finite bf16 value, shuffled, as rows of ``width`` (zeros pad the last)."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([values, values.new_zeros(-values.numel() % width)]).view(-1, width)
