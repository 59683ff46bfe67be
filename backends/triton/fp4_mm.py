"""The triton backend's fp4_mm: W4A16 on any GPU Triton targets (Hopper has no fp4 tensor cores: the weights are
decoded in the mainloop), which calls it takes, and its launch configuration (kernels: _fp4_mm_kernel.py,
imported on the first launch so the backend registers without Triton): GEMVs up to GEMV_MAX_ROWS rows of a,
a tiled GEMM whose tiles follow M, and from DEQUANTIZE_MIN_ROWS rows the weights decoded once into a's dtype for
torch's GEMM (cuBLAS on NVIDIA GPUs). W4A4 (fp4 activations) is the vendors' route on sm_100/sm_120."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends.triton._host import FP4_FORMATS, INTERPRETED, device_guard
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.specs import fp4_mm as spec
from kernelmux.specs.scaled_mm import OUT_DTYPES

__all__ = ["DEQUANTIZE_MIN_ROWS", "GEMV_MAX_ROWS", "by_dequantizing", "describe", "fp4_mm", "supports"]

# Up to this many rows of a the GEMVs run, else the tensor-core tiles: at M 4 a GEMV program per row reads the
# weights four times over (H200, 8192 x 8192 NVFP4: 90.0 us against 41.8 for 16 x 32 tiles; at M 1 24.3 against
# 43.2; perf/decisions/fp4_mm.md).
GEMV_MAX_ROWS = 1
# The GEMVs' (rows of b, K per step, warps, stages): 16 x 512 for large weights, 8 x 1024 (twice the programs)
# below GEMV_WIDE_FROM weights (8192 x 8192 NVFP4 24.3 against 29.3 us; 2880 x 2880 7.41 against 5.75).
GEMV_TILE = (16, 512, 4, 3)
GEMV_NARROW_TILE = (8, 1024, 4, 3)
GEMV_WIDE_FROM = 1 << 25
# From this many rows of a, the weights are decoded once into a dense [N, K] matrix in a's dtype (exact: e2m1 times
# its block scale; NVFP4's global scale divides the GEMM's fp32 sum) that torch's GEMM multiplies: the decoding is
# paid once, not once a row tile (perf/decisions/fp4_mm.md). Not for MXFP4 with fp16 activations (e8m0 scales leave
# fp16's range), and on NVIDIA GPUs only, where torch's GEMM with fp32 output from 16-bit operands was measured (and
# under the interpreter, whose CPU route multiplies in fp32).
DEQUANTIZE_MIN_ROWS = 32
DEQUANTIZE_TILE = (32, 512, 4)  # the decoding's rows of b, K, warps a program
# NVFP4's division of the fp32 product by the global scale, one pass into out (torch.div into a 16-bit out takes two).
DIVIDE_BLOCK, DIVIDE_WARPS = 2048, 4


@dataclass(frozen=True)
class Tiles:
    """The tiled GEMM's launch configuration."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def tiles_for(rows: int) -> Tiles:
    """The GEMM's tiles by M (perf/decisions/fp4_mm.md): 16 x 32 at decode sizes (the most programs streaming the
    weights), 64 x 128 up to 256 rows, 128 x 128 beyond."""
    if rows <= 16:
        return Tiles(16, 32, 128, 1, 4, 4)
    if rows <= 256:
        return Tiles(64, 128, 64, 8, 4, 3)
    return Tiles(128, 128, 64, 8, 8, 3)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None for W4A16 calls (any strides, both formats, every output dtype), else why not."""
    if key.mode != "w4a16":
        return ("W4A4 (fp4 activations) multiplies on fp4 tensor cores: the vendors' sm_100/sm_120 route; "
                "the triton backend serves W4A16")
    return None


def gemv_tile(size_n: int, size_k: int) -> tuple[int, int, int, int]:
    """The GEMVs' (rows of b, K per step, warps, stages) for an N x K weight."""
    return GEMV_TILE if size_n * size_k >= GEMV_WIDE_FROM else GEMV_NARROW_TILE


def by_dequantizing(rows: int, fmt: str, dtype: torch.dtype, nvidia: bool) -> bool:
    """Whether a call of ``rows`` rows of a decodes the weights into a dense matrix for torch's GEMM."""
    return nvidia and rows >= DEQUANTIZE_MIN_ROWS and not (fmt == "mxfp4" and dtype == torch.float16)


def _dense_gemm_measured(device: torch.device) -> bool:
    """Whether ``device`` takes the dequantized route's GEMM: an NVIDIA GPU, or the CPU under the interpreter."""
    return device.type == "cpu" or (device.type == "cuda" and torch.version.hip is None)


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call with ``key`` runs (for explain), at its M class's largest M."""
    if by_dequantizing(key.m_class, key.fmt, key.a_dtype, platform.kind is PlatformKind.CUDA):
        return (f"M >= {DEQUANTIZE_MIN_ROWS}: the weights decoded once into a dense {str(key.a_dtype)[6:]} matrix, "
                "then torch's GEMM with fp32 output (measured on the H200)")
    if key.m_class <= GEMV_MAX_ROWS:
        block_n, block_k, warps, stages = gemv_tile(key.n, key.k)
        return (f"M <= {GEMV_MAX_ROWS}: GEMVs, {block_n} rows of b x {block_k} of K, {warps} warps, {stages} stages "
                "(measured on the H200)")
    t = tiles_for(key.m_class)
    return (f"at M = {key.m_class}: tiles {t.block_m} x {t.block_n} x {t.block_k}, {t.num_warps} warps, "
            f"{t.num_stages} stages (measured on the H200)")


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _fp4_mm_kernel

    return _fp4_mm_kernel


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
    """The spec's fp4_mm for W4A16 calls (supports declines W4A4); arguments are validated by the caller."""
    rows, size_k = a.shape
    size_n = b.shape[0]
    out = torch.empty((rows, size_n), dtype=OUT_DTYPES[out_dtype], device=a.device)
    if rows == 0:
        return out
    scales = b_scale.view(torch.uint8)  # NVFP4's e4m3 scales are decoded from their bits
    global_scale = b_global_scale if b_global_scale is not None else scales  # a placeholder for MXFP4
    kernels = _kernels()
    common = (a, b, scales, global_scale, out)
    with device_guard(a.device):
        if by_dequantizing(rows, fmt, a.dtype, _dense_gemm_measured(a.device)):
            _dequantized_mm(kernels, a, b, scales, fmt, b_global_scale, out)
        elif rows <= GEMV_MAX_ROWS:
            block_n, block_k, warps, stages = gemv_tile(size_n, size_k)
            kernels.fp4_mm_gemv_kernel[(rows, -(-size_n // block_n))](
                *common, size_n, size_k, *a.stride(), *b.stride(), *scales.stride(), out.stride(0),
                QUANT=FP4_FORMATS[fmt], INTERPRETED=INTERPRETED, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                num_stages=stages)
        else:
            t = tiles_for(rows)
            kernels.fp4_mm_kernel[(-(-rows // t.block_m) * -(-size_n // t.block_n),)](
                *common, rows, size_n, size_k, *a.stride(), *b.stride(), *scales.stride(), out.stride(0),
                QUANT=FP4_FORMATS[fmt], HIDDEN=kernels.DOT_DTYPES[a.dtype],
                INTERPRETED=INTERPRETED, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def _dequantized_mm(kernels, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, fmt: str,
                    global_scale: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out = a @ W.T with W decoded once into a dense matrix: a's dtype on the GPU (exact), fp32 under the
    interpreter. The GEMM's output is fp32 (no reduced-precision reduction), then divided by NVFP4's global scale
    or copied, rounded once into ``out``."""
    size_n, size_k = b.shape[0], a.shape[1]
    dense = torch.empty((size_n, size_k), dtype=torch.float32 if INTERPRETED else a.dtype, device=a.device)
    block_n, block_k, warps = DEQUANTIZE_TILE
    kernels.fp4_dequantize_kernel[(-(-size_n // block_n), -(-size_k // block_k))](
        b, scales, dense, size_n, size_k, *b.stride(), *scales.stride(), dense.stride(0), QUANT=FP4_FORMATS[fmt],
        HIDDEN=kernels.DOT_DTYPES[a.dtype], INTERPRETED=INTERPRETED, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    if INTERPRETED:  # torch has no CPU kernel for mm's out_dtype
        product = torch.mm(a.float(), dense.t())
    else:
        product = torch.mm(a, dense.t(), out_dtype=torch.float32)
    if fmt == "nvfp4":
        kernels.divide_into_kernel[(-(-out.numel() // DIVIDE_BLOCK),)](product, global_scale, out, out.numel(),
                                                                       BLOCK=DIVIDE_BLOCK, num_warps=DIVIDE_WARPS)
    else:
        out.copy_(product)
