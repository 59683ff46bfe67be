"""The cuda backend's scaled_mm on Hopper (kernels/scaled_mm_sm90.cu): e4m3fn operands with 128-block scales
(DeepSeek-V3's) at prefill sizes, a warp-specialized wgmma GEMM whose tiles come by TMA and whose 128-K products are
promoted to fp32 with their scales on the CUDA cores. Which calls it takes (``supports``) and the launch. Smaller M
is the triton backend's (split-K) and the vendors'; per-tensor and per-channel scales are triton's and cuBLASLt's."""

import functools
from typing import Optional

import torch

from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import scaled_mm as spec

__all__ = ["CAPABILITY", "MIN_ROWS", "describe", "kernel_name", "scaled_mm", "shared_bytes", "source", "supports"]

CAPABILITY = HOPPER  # wgmma and TMA: sm_90a cubins, which run on sm_90 only
SOURCE_NAME = "scaled_mm_sm90.cu"
TILE = 128  # the .cu file's kTile: a CTA's M, N and K step (one scale block)
THREADS = 384  # a producer warpgroup and two consumers
# Ring stages: 5 x 32 KiB of A and B tiles. Not yet measured on the GPU (4 and 6 to try).
STAGES = 5
BOX = (TILE, TILE, 1)  # a tile's TMA box, innermost first: 128 bytes of K, 128 rows, the unit third dim
# Below this many rows of a (M's class) the 128-row tiles leave SMs idle and the weight stream is the cost: the
# triton backend's split-K tiles and DeepGEMM serve those. Not yet measured on the GPU.
MIN_ROWS = 256
OUT_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
TMA_ALIGNMENT = 16  # bytes: TMA's global address and row strides

_capability = probes.device_capability
_sm_count = probes.compute_units


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel computes calls with this key as the spec defines them, else why not."""
    if platform.capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]}a (wgmma and TMA; the cubin runs on Hopper only), this GPU "
                f"is {platform.arch}")
    if key.scaling != "block":
        return (f"{key.scaling} scales: the kernel promotes 128-block products (block scales); the triton backend and "
                "cuBLASLt serve per-tensor and per-channel scales")
    if key.fp8_dtype != torch.float8_e4m3fn:
        return f"{key.fp8_dtype} operands: e4m3fn only (e4m3fnuz is gfx942's, the aiter backend's)"
    if key.m_class < MIN_ROWS:
        return (f"up to {key.m_class} rows of a (M's class) < {MIN_ROWS}: 128-row tiles would leave SMs idle; the "
                "triton backend's split-K tiles and DeepGEMM serve decode sizes")
    if key.k % TMA_ALIGNMENT:
        return f"K = {key.k}: a multiple of {TMA_ALIGNMENT} only (TMA loads rows of 16-byte aligned strides)"
    if key.n % 2:
        return f"N = {key.n}: even only (the epilogue stores output pairs)"
    for name in ("a", "b"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along K and 16-byte aligned data and row strides (TMA), got "
                    f"{tensor_layout}")
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain)."""
    return (f"Hopper fp8 GEMM: {TILE} x {TILE} tiles, A and B by TMA into {STAGES} stages (a producer warpgroup), two "
            "consumer warpgroups of wgmma m64n128k32 each promoting every 128-K product with its block scales")


def kernel_name(out_dtype: str, stages: int = STAGES) -> str:
    """The C++ name of the kernel for the output dtype."""
    return f"scaled_mm_sm90<{OUT_CODES[out_dtype]}, {stages}>"


def shared_bytes(stages: int = STAGES) -> int:
    """scaled_mm_shared_bytes<STAGES>() in the .cu file: per stage an A and a B tile, plus the 1024-byte alignment."""
    return stages * 2 * TILE * TILE + 1024


def source(names: list[str]) -> str:
    """kernels/scaled_mm_sm90.cu with the named ABI's checks for ``names``."""
    return _params.checked_source(SOURCE_NAME, [(_params.ScaledMmParams, names)])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], name: str) -> _compile.CompiledModule:
    return _compile.compile_module_cached(source([name]), [name], arch, filename=SOURCE_NAME, arch_specific=True,
                                          defines=defines)


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, name: str) -> _driver.Kernel:
    defines = _compile.diagnostics_in_force()

    def build():
        spec_ = _driver.KernelSpec(name, _params.ScaledMmParams, THREADS, shared_bytes())
        return _compiled(_capability(device), defines, name), [spec_]

    return _LOADED.get(device, (defines, name), build)[0]


def _check_call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """Refuse, before any launch, a call the kernel cannot compute (a direct call that supports would decline)."""
    if spec.validated_scaling(scale_a, scale_b, b.shape[0]) != "block":
        raise ValueError(f"scale_a: [M, ceil(K / 128)] block scales expected, got shape {tuple(scale_a.shape)}")
    if a.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a: float8_e4m3fn expected, got {a.dtype}")
    if a.shape[1] % TMA_ALIGNMENT or b.shape[0] % 2:
        raise ValueError(f"a, b: K a multiple of {TMA_ALIGNMENT} and N even expected, got K = {a.shape[1]}, "
                         f"N = {b.shape[0]}")
    for name, tensor in (("a", a), ("b", b)):
        row_bytes = tensor.stride(0) if tensor.shape[0] > 1 else 0
        if tensor.stride(1) != 1 or (tensor.data_ptr() | row_bytes) % TMA_ALIGNMENT:
            raise ValueError(f"{name}: a unit stride along K and 16-byte aligned data and row stride expected, got "
                             f"strides {tensor.stride()} at {tensor.data_ptr():#x}")


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm with block scales; arguments are validated by the caller and accepted by ``supports``
    (a direct call the kernel cannot compute raises ValueError before any launch)."""
    rows, depth = a.shape
    cols = b.shape[0]
    out = torch.empty((rows, cols), dtype=spec.OUT_DTYPES[out_dtype], device=a.device)
    if rows == 0:
        return out
    _check_call(a, b, scale_a, scale_b)
    tiles = -(-rows // TILE) * -(-cols // TILE)
    with torch.cuda.device(a.device):
        kernel = _kernel(a.device, kernel_name(out_dtype))
        kernel((min(tiles, _sm_count(a.device)), 1, 1), a_map=_driver.tensor_map(a.unsqueeze(0), BOX),
               b_map=_driver.tensor_map(b.unsqueeze(0), BOX), scale_a=scale_a, scale_b=scale_b, bias=bias, out=out,
               m=rows, n=cols, k=depth, scale_a_stride_m=scale_a.stride(0), scale_a_stride_k=scale_a.stride(1),
               scale_b_stride_n=scale_b.stride(0), scale_b_stride_k=scale_b.stride(1),
               bias_stride=bias.stride(0) if bias is not None else 0, out_stride=out.stride(0))
    return out
