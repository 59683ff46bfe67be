"""The cuda backend's quantize_fp8 (kernels/quantize_fp8.cu): e4m3fn codes from bf16/fp16/fp32 rows of 16-byte
vectors. Which calls it takes (``supports``) and their launches: per_group and per_token in one launch,
per_tensor in one (up to TENSOR_ONE_CTA_MAX_ROWS rows) or two (per-CTA maxima into a workspace, then the codes;
no fill, no host sync). Scales are written in the layout the spec asks for, through their strides."""

import functools
from typing import Optional

import torch

from kernelmux.backends.cuda import _compile, _driver, _params
from kernelmux.backends.cuda._targets import HOPPER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import quantize_fp8 as spec

__all__ = ["CAPABILITY", "GROUP_SLOTS", "amax_partials", "check_rows", "describe", "division", "group_kernel_name",
           "quantize_fp8", "row_kernel_name", "row_shape", "shape_reason", "source", "supports", "token_max_warps",
           "vector_elements"]

CAPABILITY = HOPPER  # the kernels need sm_89's cvt only; registered where they are measured
SOURCE_NAME = "quantize_fp8.cu"
KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the .cu file's kBf16, kFp16, kFp32
ROW_MODES = {"token": 0, "tensor": 1, "partials": 2, "amax": 3}  # quantize_rows' MODE
VECTOR_BYTES = 16
# per_group: 16-byte vectors a thread has in flight (one a group-slot; a warp task is GROUP_SLOTS x 32 / LANES
# groups of a row). 4: a warp task of 1 x 128 bf16 groups is 8 groups, so H 2048 and 7168 (16 and 56 groups) are
# whole tasks, and 64 bytes a thread in flight at 40 registers (~6 CTAs of 256 an SM: ~96 KiB). Not yet measured
# on the GPU against 2 and 8.
GROUP_SLOTS = 4
GROUP_THREADS = 8 * 32  # kGroupWarps in the .cu file
# per_token: a CTA a row, each thread holding up to MAX_ROW_VECS 16-byte vectors of it from the row's maximum to
# its codes; row_shape gives the row ROW_WARPS warps when that many hold it, more (a power of two, up to
# token_max_warps) beyond, and rows wider than 2048 vectors (16384 bf16) read the rest again from L2. H200, T 4096 x
# H 2048 / 7168, us at 1 / 2 / 4 / 8 vectors a thread (the warps that hold the row): 9.38 / 7.53 / 7.60 / 7.75 and
# 32.0 / 27.7 / 24.2 / 23.0: the best at 4 warps a row in both.
ROW_WARPS = 4
MAX_ROW_VECS = 8
# per_tensor: up to this many rows one CTA of TENSOR_ONE_CTA_THREADS computes the maximum and the codes (one
# launch); more take two launches of tensor_rows_per_cta rows a CTA, shaped as per_token's. H200, us at 1 / 2 / 4 /
# 8 / 16 rows a CTA: T 4096 x 2048 16.4 / 14.9 / 12.9 / 15.6 / 24.4, T 4096 x 7168 39.7 / 38.8 / 40.3 / 48.6 /
# 43.6, T 128 x 7168 3.7 / 4.5 / 6.3 / 10.1 / 17.0: up to TENSOR_MAX_ROWS_PER_CTA rows while the grid keeps
# TENSOR_CTAS_PER_SM CTAs an SM.
TENSOR_ONE_CTA_MAX_ROWS = 4
TENSOR_ONE_CTA_THREADS = 1024
TENSOR_MAX_ROWS_PER_CTA = 4
TENSOR_CTAS_PER_SM = 4
MAX_GRID = 2**31 - 1

_capability = probes.device_capability
_sm_count = probes.compute_units


def vector_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a 16-byte vector."""
    return VECTOR_BYTES // dtype.itemsize


def shape_reason(x_dtype: torch.dtype, cols: int, granularity: str, group_size: Optional[int], fp8_dtype: str,
                 dense_rows: bool) -> Optional[str]:
    """Why the kernels do not compute a call of this kind (None when they do); no device needed."""
    if fp8_dtype != "e4m3fn":
        return (f"fp8_dtype {fp8_dtype!r}: e4m3fn codes only (e4m3fnuz is gfx942's format, which no NVIDIA cvt "
                "writes; the triton backend serves it)")
    if x_dtype not in KINDS:
        return f"x dtype {x_dtype}: bf16, fp16 or fp32 only"
    vector = vector_elements(x_dtype)
    if cols % vector:
        return (f"K = {cols}: needs a multiple of {vector} for {x_dtype} (whole 16-byte vectors; the triton backend "
                "serves the rest)")
    if not dense_rows:
        return ("x needs a unit stride along K and 16-byte aligned data and row strides (the kernels' 16-byte "
                "loads)")
    if granularity == "per_group":
        lanes = group_size // vector if group_size % vector == 0 else 0
        if lanes not in (1, 2, 4, 8, 16, 32):
            return (f"group_size = {group_size}: needs {vector} x a power of two up to {32 * vector} for {x_dtype} "
                    "(a group is whole 16-byte vectors over a power of two of a warp's lanes)")
    return None


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernels compute calls with this key as the spec defines them, else why not."""
    if platform.capability != CAPABILITY:
        return (f"needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper, where these kernels are measured; they need "
                f"sm_89's e4m3 cvt), this GPU is {platform.arch}")
    return shape_reason(key.x_dtype, key.k, key.granularity, key.group_size, key.fp8_dtype, key.x_layout.dense_rows)


def describe(key: spec.Key, platform: Platform) -> str:
    """What a call runs (for explain)."""
    if key.granularity == "per_group":
        lanes = key.group_size // vector_elements(key.x_dtype)
        return (f"one launch: warp tasks of {GROUP_SLOTS} x {32 // lanes} groups of a row, {lanes} lanes a group, "
                f"{GROUP_SLOTS} 16-byte loads a lane in flight (perf/decisions/quantize_fp8.md)")
    if key.granularity == "per_token":
        return (f"one launch: a CTA a row, up to {MAX_ROW_VECS} 16-byte vectors a thread held from the maximum to "
                "the codes (perf/decisions/quantize_fp8.md)")
    return (f"one CTA up to {TENSOR_ONE_CTA_MAX_ROWS} rows, else two launches: per-CTA maxima of up to "
            f"{TENSOR_MAX_ROWS_PER_CTA} rows, then the codes in reverse CTA order (perf/decisions/quantize_fp8.md)")


def group_kernel_name(kind: int, ue8m0: bool, lanes: int, slots: int) -> str:
    return f"quantize_groups<{kind}, {str(ue8m0).lower()}, {lanes}, {slots}>"


def row_kernel_name(kind: int, ue8m0: bool, mode: int, vecs: int) -> str:
    return f"quantize_rows<{kind}, {str(ue8m0).lower()}, {mode}, {vecs}>"


def source(groups: list[str], rows: list[str]) -> str:
    """kernels/quantize_fp8.cu with the named ABI's checks for the kernels ``groups`` and ``rows``."""
    return _params.checked_source(SOURCE_NAME, [(_params.QuantizeGroupsParams, groups),
                                                (_params.QuantizeRowsParams, rows)])


@functools.cache
def _compiled(arch: tuple[int, int], defines: tuple[str, ...], name: str, group: bool) -> _compile.CompiledModule:
    """One NVRTC compilation per arch, macro set and kernel (each call type needs one or two)."""
    return _compile.compile_module_cached(source([name], []) if group else source([], [name]), [name], arch,
                                          filename=SOURCE_NAME, defines=defines)


_LOADED = _driver.LoadedKernels()


def _kernel(device: torch.device, name: str, threads: int) -> _driver.Kernel:
    """Kernel ``name`` (a group or row kernel name) launched with ``threads`` a CTA, loaded on ``device``."""
    defines = _compile.diagnostics_in_force()
    group = name.startswith("quantize_groups")
    params = _params.QuantizeGroupsParams if group else _params.QuantizeRowsParams

    def build():
        return _compiled(_capability(device), defines, name, group), [_driver.KernelSpec(name, params, threads)]

    return _LOADED.get(device, (defines, name, threads), build)[0]


def division(divisor: int) -> tuple[int, int]:
    """(magic, shift) with n // divisor == (n * magic) >> shift for 0 <= n < 2^31 (magic < 2^32)."""
    shift = 31 + max(divisor - 1, 0).bit_length()  # 31 + ceil(log2(divisor))
    return -(-(1 << shift) // divisor), shift


def token_max_warps(vecs: int) -> int:
    """The kernel's launch bounds for kToken at ``vecs`` vectors a thread: 256 threads at 8, else 512."""
    return 8 if vecs >= 8 else 16


def row_shape(vectors: int) -> tuple[int, int]:
    """(warps, vectors a thread) of a row kernel's CTA for rows of ``vectors`` 16-byte vectors."""
    vecs = 1
    while vecs < MAX_ROW_VECS and ROW_WARPS * 32 * vecs < vectors:
        vecs *= 2
    warps = 1
    while warps < token_max_warps(vecs) and warps * 32 * vecs < vectors:
        warps *= 2
    return warps, vecs


def tensor_rows_per_cta(rows: int, sm_count: int) -> int:
    """Rows a CTA of per_tensor's two passes takes."""
    return max(1, min(TENSOR_MAX_ROWS_PER_CTA, rows // (TENSOR_CTAS_PER_SM * sm_count)))


def check_rows(x: torch.Tensor) -> None:
    """Refuse rows that 16-byte vector loads cannot read: a stride along K, unaligned data or row stride."""
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: a unit stride along K expected, got strides {x.stride()}")
    row_bytes = x.stride(0) * x.element_size() if x.shape[0] > 1 else 0  # a single row's stride is never stepped
    if (x.data_ptr() | row_bytes) % VECTOR_BYTES:
        raise ValueError(f"x: 16-byte aligned data and row stride expected, got address {x.data_ptr():#x} and row "
                         f"stride {row_bytes} bytes")


def _check_call(x: torch.Tensor, granularity: str, group_size: int, fp8_dtype: str) -> None:
    """Refuse, before any launch, a call the kernels cannot compute (a direct call that supports would decline)."""
    if fp8_dtype != "e4m3fn":
        raise ValueError(f"fp8_dtype: the cuda kernels write e4m3fn codes only, got {fp8_dtype!r}")
    if x.dtype not in KINDS:
        raise ValueError(f"x: bf16, fp16 or fp32 expected, got {x.dtype}")
    vector = vector_elements(x.dtype)
    if x.shape[1] % vector:
        raise ValueError(f"x: K a multiple of {vector} expected for {x.dtype}, got {x.shape[1]}")
    check_rows(x)
    if granularity == "per_group" and (group_size % vector or group_size // vector not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"group_size: {vector} x a power of two up to {32 * vector} expected for {x.dtype}, got "
                         f"{group_size}")


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Launch per_tensor's first pass (kAmax) over ``x`` (rows > 0, accepted by _check_call) and return its
    workspace: the maximum of |x| over each CTA's rows, fp32 (quantize_nvfp4's dynamic global scale reads it)."""
    rows, cols = x.shape
    warps, vecs = row_shape(cols // vector_elements(x.dtype))
    rows_per_cta = tensor_rows_per_cta(rows, _sm_count(x.device))
    ctas = -(-rows // rows_per_cta)
    partials = torch.empty(ctas, dtype=torch.float32, device=x.device)
    kernel = _kernel(x.device, row_kernel_name(KINDS[x.dtype], False, ROW_MODES["amax"], vecs), warps * 32)
    kernel((ctas, 1, 1), overlap_previous=True, x=x, q=None, scale=None, partials=partials, rows=rows, cols=cols,
           rows_per_cta=rows_per_cta, num_partials=ctas, x_stride=x.stride(0), q_stride=0, scale_stride=0)
    return partials


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_fp8 on the cuda kernels; arguments are validated by the caller and accepted by
    supports (a direct call it cannot compute raises ValueError before any launch)."""
    _check_call(x, granularity, group_size, fp8_dtype)
    rows, cols = x.shape
    device = x.device
    q, scale = spec.fake(x, granularity, group_size, ue8m0, fp8_dtype, scale_layout)  # the spec's shapes and strides
    if rows == 0:
        if granularity == "per_tensor":  # the amax of nothing is 0: the floor, a power of two already
            scale.fill_(spec.SCALE_FLOOR)
        return q, scale
    kind, vector = KINDS[x.dtype], vector_elements(x.dtype)
    codes = q.view(torch.uint8)
    with torch.cuda.device(device):
        if granularity == "per_group":
            lanes = group_size // vector
            groups = scale.shape[1]
            tasks_per_row = -(-groups // (GROUP_SLOTS * 32 // lanes))
            if rows * tasks_per_row >= 2**31:
                raise ValueError(f"x: at most {2**31 - 1} warp tasks, got {rows} rows x {tasks_per_row}")
            magic, shift = division(tasks_per_row)
            kernel = _kernel(device, group_kernel_name(kind, ue8m0, lanes, GROUP_SLOTS), GROUP_THREADS)
            kernel((-(-rows * tasks_per_row // (GROUP_THREADS // 32)), 1, 1), overlap_previous=True,
                   x=x, q=codes, scale=scale, rows=rows, cols=cols, groups=groups, tasks_per_row=tasks_per_row,
                   row_shift=shift, row_magic=magic, x_stride=x.stride(0), q_stride=codes.stride(0),
                   scale_stride_m=scale.stride(0), scale_stride_g=scale.stride(1))
            return q, scale
        vectors = cols // vector
        fields = dict(x=x, q=codes, scale=scale, rows=rows, cols=cols, x_stride=x.stride(0),
                      q_stride=codes.stride(0), scale_stride=scale.stride(0))
        warps, vecs = row_shape(vectors)
        if granularity == "per_token":
            kernel = _kernel(device, row_kernel_name(kind, ue8m0, ROW_MODES["token"], vecs), warps * 32)
            kernel((rows, 1, 1), overlap_previous=True, partials=None, rows_per_cta=1, num_partials=0, **fields)
        elif rows <= TENSOR_ONE_CTA_MAX_ROWS:
            kernel = _kernel(device, row_kernel_name(kind, ue8m0, ROW_MODES["tensor"], vecs),
                             TENSOR_ONE_CTA_THREADS)
            kernel((1, 1, 1), overlap_previous=True, partials=None, rows_per_cta=rows, num_partials=0, **fields)
        else:
            rows_per_cta = tensor_rows_per_cta(rows, _sm_count(device))
            ctas = -(-rows // rows_per_cta)
            partials = torch.empty(ctas, dtype=torch.float32, device=device)
            for mode in ("amax", "partials"):
                kernel = _kernel(device, row_kernel_name(kind, ue8m0, ROW_MODES[mode], vecs), warps * 32)
                kernel((ctas, 1, 1), overlap_previous=True, partials=partials, rows_per_cta=rows_per_cta,
                       num_partials=ctas, **fields)
    return q, scale
