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

__all__ = ["CAPABILITY", "MIN_ROWS", "describe", "kernel_name", "row_waves", "scaled_mm", "shared_bytes", "source",
           "supports"]

CAPABILITY = HOPPER  # wgmma and TMA: sm_90a cubins, which run on sm_90 only
SOURCE_NAME = "scaled_mm_sm90.cu"
TILE = 128  # the .cu file's kTile: a tile's N, its K step (one scale block) and its rows a wave
THREADS = 384  # a producer warpgroup and two consumers
# Tiles of 1 or 2 waves of 128 rows (WAVES): 256 x 128 tiles move 3/4 of the bytes a flop of 128 x 128 ones (at
# M 4096 the 128 x 128 tiles' loads alone took 813 us of the 978), but leave more SMs idle on the last wave of tiles
# and hold one step in flight a consumer instead of two. Ring stages of each: 5 x 32 KiB, 4 x 48 KiB (H200: 4, 5 and
# 6 stages within 2% at one wave; 3 stages 1-4% slower than 4 at two; perf/decisions/scaled_mm.md).
STAGES = {1: 5, 2: 4}
# 256-row tiles once there are enough of them for this share of the SMs. H200 (132 SMs), against 128 x 128 tiles in
# the same run: 56 tiles (M 256, N 7168, K 16384) 105 us against 63; 112 (M 512, N 7168, K 2048) 22.2 against 22.9;
# 224 (M 1024, N 7168, K 16384) 242 against 264; 256 (M 4096, N 2048, K 7168) 112 against 129; and faster at every
# larger shape measured (perf/decisions/scaled_mm.md).
MIN_SM_SHARE_2_WAVES = 0.75
# Below this many rows of a (M's class) the 128-row tiles leave SMs idle and the weight stream is the cost: the
# triton backend's split-K tiles and DeepGEMM serve those. At M 256 the kernel took 63.6 us against triton's 110.3
# (N 7168, K 16384; H200).
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
    return (f"Hopper fp8 GEMM: persistent CTAs over {TILE} x {TILE} or {2 * TILE} x {TILE} tiles (row_waves), A and B "
            "by TMA (a producer warpgroup), two consumer warpgroups of wgmma m64n128k32 each promoting every 128-K "
            "product with its block scales")


def kernel_name(out_dtype: str, waves: int, stages: Optional[int] = None) -> str:
    """The C++ name of the kernel for the output dtype and tiles of ``waves`` x 128 rows."""
    return f"scaled_mm_sm90<{OUT_CODES[out_dtype]}, {stages or STAGES[waves]}, {waves}>"


def shared_bytes(waves: int, stages: Optional[int] = None) -> int:
    """scaled_mm_shared_bytes<STAGES, WAVES>() in the .cu file: per stage an A tile of ``waves`` x 128 rows and a B
    tile, plus the 1024-byte alignment."""
    return (stages or STAGES[waves]) * (waves + 1) * TILE * TILE + 1024


def row_waves(rows: int, cols: int, sm_count: int) -> int:
    """128-row waves a tile for an M x N output: 2 when its 256 x 128 tiles would busy MIN_SM_SHARE_2_WAVES of the
    SMs, else 1."""
    tiles_of_2 = -(-rows // (2 * TILE)) * -(-cols // TILE)
    return 2 if tiles_of_2 >= MIN_SM_SHARE_2_WAVES * sm_count else 1


def source(names: list[str]) -> str:
    """kernels/scaled_mm_sm90.cu with the named ABI's checks for ``names``."""
    return _params.checked_source(SOURCE_NAME, [(_params.ScaledMmParams, names)])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], name: str) -> _compile.CompiledModule:
    return _compile.compile_module_cached(source([name]), [name], arch, filename=SOURCE_NAME, arch_specific=True,
                                          defines=defines)


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, name: str, waves: int) -> _driver.Kernel:
    defines = _compile.diagnostics_in_force()

    def build():
        spec_ = _driver.KernelSpec(name, _params.ScaledMmParams, THREADS, shared_bytes(waves))
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
    sm_count = _sm_count(a.device)
    waves = row_waves(rows, cols, sm_count)
    tiles = -(-rows // (waves * TILE)) * -(-cols // TILE)
    with torch.cuda.device(a.device):
        kernel = _kernel(a.device, kernel_name(out_dtype, waves), waves)
        # TMA boxes, innermost first: 128 bytes of K, a tile's rows, the unit third dim
        kernel((min(tiles, sm_count), 1, 1), a_map=_driver.tensor_map(a.unsqueeze(0), (TILE, waves * TILE, 1)),
               b_map=_driver.tensor_map(b.unsqueeze(0), (TILE, TILE, 1)), scale_a=scale_a, scale_b=scale_b,
               bias=bias, out=out, m=rows, n=cols, k=depth, scale_a_stride_m=scale_a.stride(0),
               scale_a_stride_k=scale_a.stride(1), scale_b_stride_n=scale_b.stride(0),
               scale_b_stride_k=scale_b.stride(1),
               bias_stride=bias.stride(0) if bias is not None else 0, out_stride=out.stride(0))
    return out
