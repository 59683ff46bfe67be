"""The cuda backend's fp4_mm: W4A16 at decode sizes (up to MAX_ROWS rows of a) on the tensor cores, the weights
decoded in registers (kernels/fp4_mm.cu on kernels/fp4_mma.cuh, fused_moe's fp4 decoding): which calls it takes
(``supports``) and the launch, a CTA per 16 weight rows whose warps split K (more of them when N has few
tiles). Larger M is the triton backend's
tensor-core GEMM; W4A4 the vendors' fp4 tensor cores."""

import functools
from typing import Optional

import torch

from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import fp4_mm as spec

__all__ = ["CAPABILITY", "MAX_ROWS", "describe", "fp4_mm", "kernel_name", "source", "supports", "warps_for"]

CAPABILITY = HOPPER  # where it was measured (the kernel needs sm_89: cvt from e4m3)
MAX_ROWS = 32  # the .cu file's kFp4MmMaxGroups x 8: the MMA's B columns, 8 rows of a a group
TILE_ROWS = 16  # weight rows a CTA
# Warps a CTA (splitting K): from MIN_WARPS, doubled up to MAX_WARPS while the grid holds fewer than WARPS_PER_SM
# warps a SM and each warp keeps at least MIN_STEPS steps of K. H200, M 1, NVFP4 (us at 4 / 8 / 16 warps; the
# decision file has every M and format): 8192 x 8192 (512 CTAs) 20.4 / 22.8 / 26.8; 7168 x 2048 (448) 7.1 / 8.1 /
# 11.4; 2880 x 2880 (180 CTAs, 23 steps) 7.2 / 5.4 / 7.0; 2048 x 7168 (128) 16.3 / 9.8 / 7.4.
MIN_WARPS, MAX_WARPS, WARPS_PER_SM, MIN_STEPS = 4, 16, 12, 2
STEP_K = 128  # K of a warp step (fp4_mma.cuh's kFp4StepK)
ROW_CODES = 32  # a lane loads 16 bytes of codes: K a multiple of 32
OUT_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
SOURCE_NAME = "fp4_mm.cu"

_capability = probes.device_capability
_sm_count = probes.compute_units


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel computes calls with this key as the spec defines them, else why not."""
    if key.mode != "w4a16":
        return "W4A4 (fp4 activations) multiplies on fp4 tensor cores: the vendors' sm_100/sm_120 route"
    if platform.capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper, where it was measured), this GPU is "
                f"{platform.arch}")
    if key.m_class > MAX_ROWS:
        return (f"up to {key.m_class} rows of a (M's class) > {MAX_ROWS}: the GEMV's MMAs take a's rows as 8-wide "
                "B columns, 4 groups at most (the triton backend's tensor-core tiles serve larger M)")
    if key.fmt == "mxfp4" and key.a_dtype == torch.float16:
        return ("MXFP4 with fp16 activations: the tensor cores would take the weights as fp16, whose range e8m0 "
                "scales leave (the triton backend decodes those to fp32)")
    if key.k % ROW_CODES:
        return f"K = {key.k}: a multiple of {ROW_CODES} only (a lane loads 16 bytes of packed codes)"
    for name in ("a", "b"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along its last dim and 16-byte aligned data and row strides (the "
                    f"kernel's 16-byte loads), got {tensor_layout}")
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain)."""
    return (f"W4A16 GEMV on the tensor cores: a CTA a {TILE_ROWS} weight rows, {MIN_WARPS}-{MAX_WARPS} warps "
            "splitting K (more where N has few tiles), the codes decoded in registers once for all of a's rows (8 a "
            "B column group)")


def warps_for(tiles: int, k: int, sm_count: int) -> int:
    """Warps a CTA for ``tiles`` CTAs over K = ``k``."""
    warps, steps = MIN_WARPS, -(-k // STEP_K)
    while warps < MAX_WARPS and tiles * warps < WARPS_PER_SM * sm_count and steps >= 2 * warps * MIN_STEPS:
        warps *= 2
    return warps


def kernel_name(warps: int, bf16: bool, nvfp4: bool, out_dtype: str) -> str:
    """The C++ name of the kernel for the CTA's warps, the activations' dtype, the format and the output dtype."""
    return f"fp4_mm_gemv<{warps}, {str(bf16).lower()}, {str(nvfp4).lower()}, {OUT_CODES[out_dtype]}>"


def source(names: list[str]) -> str:
    """kernels/fp4_mm.cu with the named ABI's checks for ``names``."""
    return _params.checked_source(SOURCE_NAME, [(_params.Fp4MmParams, names)])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], name: str) -> _compile.CompiledModule:
    return _compile.compile_module_cached(source([name]), [name], arch, filename=SOURCE_NAME, defines=defines)


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, name: str, warps: int) -> _driver.Kernel:
    defines = _compile.diagnostics_in_force()

    def build():
        spec_ = _driver.KernelSpec(name, _params.Fp4MmParams, warps * 32)
        return _compiled(_capability(device), defines, name), [spec_]

    return _LOADED.get(device, (defines, name), build)[0]


def fp4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str = "nvfp4",
    a_scale: Optional[torch.Tensor] = None,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
    out_dtype: str = "bfloat16",
) -> torch.Tensor:
    """The spec's fp4_mm, W4A16 up to MAX_ROWS rows of a; arguments are validated by the caller and accepted
    by ``supports``."""
    rows, size_k = a.shape
    size_n = b.shape[0]
    out = torch.empty((rows, size_n), dtype=spec.OUT_DTYPES[out_dtype], device=a.device)
    if rows == 0:
        return out
    if rows > MAX_ROWS:  # supports declines these by M's class; a direct call is refused before any launch
        raise ValueError(f"a: at most {MAX_ROWS} rows (the GEMV's B columns), got {rows}")
    if fmt == "nvfp4":  # the kernel reads e4m3 codes as bytes
        b_scale = b_scale.view(torch.uint8)
    with torch.cuda.device(a.device):
        tiles = -(-size_n // TILE_ROWS)
        warps = warps_for(tiles, size_k, _sm_count(a.device))
        kernel = _kernel(a.device, kernel_name(warps, a.dtype == torch.bfloat16, fmt == "nvfp4", out_dtype), warps)
        kernel((tiles, 1, 1), a=a, b=b, b_scale=b_scale, b_global=b_global_scale, out=out, m=rows,
               n=size_n, k=size_k, a_stride=a.stride(0), b_stride=b.stride(0), scale_stride_n=b_scale.stride(0),
               scale_stride_k=b_scale.stride(1), out_stride=out.stride(0))
    return out
