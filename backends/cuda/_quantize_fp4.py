"""The cuda backend's fp4 quantization (kernels/quantize_fp4.cu), shared by its quantize_nvfp4 and quantize_mxfp4:
which calls the kernel takes (``shape_reason``), the refusal of a direct call it cannot compute, and the launch:
one for a passed-in global scale and for MXFP4, two for NVFP4's dynamic one (quantize_fp8's per-CTA maxima, then
the codes; no fill, no host sync). Block scales go straight to their linear or 128x4 swizzled offsets."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda import quantize_fp8 as fp8
from kernelmux.backends.cuda._targets import HOPPER

__all__ = ["BLOCKS", "CAPABILITY", "FORMATS", "SLOTS", "THREADS", "check_call", "describe", "kernel_name", "lanes",
           "platform_reason", "quantize", "shape_reason", "source"]

CAPABILITY = HOPPER  # the kernel needs sm_89's e4m3 cvt only; registered where it is measured
SOURCE_NAME = "quantize_fp4.cu"
KINDS = fp8.KINDS  # the kinds quantize_common.cuh defines: bf16, fp16, fp32
FORMATS = {"nvfp4_given": 0, "nvfp4_dynamic": 1, "floor": 2, "ceil": 3}  # the .cu file's kNvfp4Given, ...
BLOCKS = {"nvfp4_given": 16, "nvfp4_dynamic": 16, "floor": 32, "ceil": 32}  # elements a block scale covers
# 16-byte vectors a thread has in flight: a warp task is SLOTS x 512 contiguous bytes of a row (64 NVFP4 / 32 MXFP4
# blocks of bf16: H 7168 is 7 tasks, H 2880 3). Swept on the H200 with the CTA (perf/decisions/quantize_nvfp4.md).
SLOTS = 4
THREADS = 4 * 32  # kWarps in the .cu file
MAX_TASKS = 2**31


def lanes(fmt: str, dtype: torch.dtype) -> int:
    """Lanes (16-byte vectors) a block of ``fmt`` spans for ``dtype``."""
    return BLOCKS[fmt] // fp8.vector_elements(dtype)


def shape_reason(x_dtype: torch.dtype, cols: int, block: int, dense_rows: bool) -> Optional[str]:
    """Why the kernel does not compute a call of this kind (None when it does); no device needed."""
    if x_dtype not in KINDS:
        return f"x dtype {x_dtype}: bf16, fp16 or fp32 only"
    vector = fp8.vector_elements(x_dtype)
    if cols % vector or block % vector:
        return (f"K = {cols}: needs whole 16-byte vectors of {vector} {x_dtype} elements in every block (the triton "
                "backend serves the rest)")
    if not dense_rows:
        return "x needs a unit stride along K and 16-byte aligned data and row strides (the kernel's 16-byte loads)"
    return None


def platform_reason(capability: tuple[int, int], arch: str) -> Optional[str]:
    """Why the kernel is not registered for this GPU (None on Hopper)."""
    if capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper, where this kernel is measured; it needs sm_89's "
                f"e4m3 cvt), this GPU is {arch}")
    return None


def describe(fmt: str, dtype: torch.dtype) -> str:
    """What a call of format ``fmt`` runs (for explain)."""
    n = lanes(fmt, dtype)
    first = ("two launches: quantize_fp8's per-CTA maxima (per_tensor's first pass), then " if fmt == "nvfp4_dynamic"
             else "one launch: ")
    return (f"{first}warp tasks of {SLOTS} x {32 // n} blocks of a row, {n} lanes a block, {SLOTS} 16-byte loads a "
            "lane in flight, e2m1 codes by an FFMA-rounding integer encoder (perf/decisions/quantize_nvfp4.md)")


def kernel_name(fmt: int, kind: int, swizzled: bool, slots: int) -> str:
    return f"quantize_fp4<{fmt}, {kind}, {str(swizzled).lower()}, {slots}>"


def source(names: list[str]) -> str:
    """kernels/quantize_fp4.cu with the named ABI's checks for the kernels ``names``."""
    return _params.checked_source(SOURCE_NAME, [(_params.QuantizeFp4Params, names)])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], name: str) -> _compile.CompiledModule:
    """One NVRTC compilation per arch, macro set and kernel."""
    return _compile.compile_module_cached(source([name]), [name], arch, filename=SOURCE_NAME, defines=defines)


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, name: str) -> _driver.Kernel:
    """Kernel ``name`` loaded on ``device``."""
    defines = _compile.diagnostics_in_force()

    def build():
        return (_compiled(fp8._capability(device), defines, name),
                [_driver.KernelSpec(name, _params.QuantizeFp4Params, THREADS)])

    return _LOADED.get(device, (defines, name), build)[0]


def check_call(x: torch.Tensor, block: int) -> None:
    """Refuse, before any launch, a call the kernel cannot compute (a direct call that supports would decline)."""
    if x.dtype not in KINDS:
        raise ValueError(f"x: bf16, fp16 or fp32 expected, got {x.dtype}")
    vector = fp8.vector_elements(x.dtype)
    if x.shape[1] % vector or block % vector:
        raise ValueError(f"x: K a multiple of {vector} expected for {x.dtype}, got {x.shape[1]}")
    fp8.check_rows(x)


def quantize(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: torch.Tensor, swizzled: bool,
             gs_in: Optional[torch.Tensor] = None, gs_out: Optional[torch.Tensor] = None) -> None:
    """Write the codes of ``x`` (rows > 0, accepted by check_call) into ``q`` and its block scales (bytes) into
    ``scale`` in format ``fmt``; NVFP4's global scale from ``gs_in`` (passed in) or x's maximum, into ``gs_out``."""
    rows, cols = x.shape
    device = x.device
    blocks = cols // BLOCKS[fmt]
    tasks_per_row = -(-blocks // (SLOTS * 32 // lanes(fmt, x.dtype)))
    if rows * tasks_per_row >= MAX_TASKS:
        raise ValueError(f"x: at most {MAX_TASKS - 1} warp tasks, got {rows} rows x {tasks_per_row}")
    magic, shift = fp8.division(tasks_per_row)
    with torch.cuda.device(device):
        if swizzled:
            scale.zero_()  # the padding's scales are 0; the kernel writes the rest
        partials = fp8.amax_partials(x) if fmt == "nvfp4_dynamic" else None
        kernel = _kernel(device, kernel_name(FORMATS[fmt], KINDS[x.dtype], swizzled, SLOTS))
        kernel((-(-rows * tasks_per_row // (THREADS // 32)), 1, 1), overlap_previous=True,
               x=x, q=q, scale=scale, gs_in=gs_in, gs_out=gs_out, partials=partials, rows=rows, blocks=blocks,
               tasks_per_row=tasks_per_row, row_shift=shift, num_partials=0 if partials is None else partials.numel(),
               row_magic=magic, x_stride=x.stride(0), q_stride=q.stride(0), scale_stride=scale.stride(0))
