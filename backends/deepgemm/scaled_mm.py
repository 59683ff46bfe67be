"""The deepgemm backend's scaled_mm: DeepGEMM's fp8_gemm_nt (its SM90 1D2D kernel) for block scales
(1 x 128 groups of a, 128 x 128 blocks of b), with the scale-layout conversion (``prepare_scales``)
kept apart so the bench can time it on its own."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.deepgemm import DEEPGEMM, arch_problem, transform_scales
from kernelmux.platforms import Platform
from kernelmux.specs import scaled_mm as spec

__all__ = ["metadata", "prepare_scales", "scaled_mm", "supports"]

# DeepGEMM's recipe (gran_m, gran_n, gran_k): one scale per 1 x 128 group of a and per 128 x 128
# block of b, kernelmux's block layout. On sm_90 with fp32 scales it selects sm90_fp8_gemm_1d2d
# (csrc/apis/gemm.hpp, fp8_fp4_gemm_nt: gran_n 128 -> 1D2D).
RECIPE = (1, spec.BLOCK, spec.BLOCK)
# The 1D2D kernel traps unless shape_n % 8 == 0 (DG_TRAP_ONLY_DEVICE_ASSERT in
# sm90_fp8_gemm_1d2d.cuh); it is also what a 16-byte TMA row stride of the bf16 output needs.
N_MULTIPLE = 8
# K: DeepGEMM's own FP8 tests use only K % 128 == 0 (sgl_deep_gemm/tests/generators.py). A short
# last K block would rely on TMA's zero fill, which no test of theirs or of kernelmux's named cases
# (K = 200, 129, 100 are not even 16-byte rows) exercises, so it is declined, not assumed.
K_MULTIPLE = spec.BLOCK
TMA_BYTES = 16  # TMA: global address and every row stride a multiple of 16 bytes
SCALE_ROWS = TMA_BYTES // 4  # sfa's column stride: M rounded up to 16 bytes of fp32 (get_tma_aligned_size)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fp8_gemm_nt computes this call exactly as the spec defines it, else why not."""
    reason = arch_problem(platform)
    if reason is not None:
        return reason
    if key.scaling != "block":
        return (f"block scales only (1 x 128 groups of a, 128 x 128 blocks of b), got {key.scaling} "
                "scales")
    if key.fp8_dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn operands only (DeepGEMM's check_ab_fp8_fp4), got {key.fp8_dtype}"
    if key.out_dtype != "bfloat16":
        return f"bfloat16 output only (sm90_fp8_gemm_1d2d asserts a bf16 d), got {key.out_dtype}"
    if key.bias_dtype is not None:
        # Its only addend, the accumulator c, needs an fp32 d and the 1D2D kernel refuses it; a
        # bias added afterwards would round the output twice.
        return "no bias: the SM90 block-scaled kernel takes no accumulator input c"
    if key.k % K_MULTIPLE:
        return (f"K % {K_MULTIPLE} == 0 only (the K DeepGEMM's FP8 tests cover; a short last K block "
                f"is unverified), got K = {key.k}")
    if key.n % N_MULTIPLE:
        return f"N % {N_MULTIPLE} == 0 only (the 1D2D kernel traps otherwise), got N = {key.n}"
    return None


def prepare_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, n: int,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Metadata conversion: kernelmux's canonical fp32 block scales, ``scale_a [M, ceil(K/128)]``
    and ``scale_b [ceil(N/128), ceil(K/128)]``, in the layouts fp8_gemm_nt reads on sm_90.

    Returns ``(sfa, sfb)``: ``sfa`` the same values MN-major and TMA-aligned (a ``[M, ceil(K/128)]``
    view with strides ``(1, M rounded up to 4)``), ``sfb`` contiguous. Both come from DeepGEMM's
    own ``transform_sf_into_required_layout``, the function fp8_gemm_nt applies itself, so the
    GEMM takes them as they are. A weight's ``sfb`` can be prepared once and kept."""
    def convert():
        sfa = transform_scales(scale_a, mn=m, k=k, recipe=RECIPE, is_sfa=True)
        # SM90's sfb must be contiguous (or transposed-contiguous): check_sf_layout's sm90_sfb_check.
        sfb = transform_scales(scale_b.contiguous(), mn=n, k=k, recipe=RECIPE, is_sfa=False)
        return sfa, sfb

    # The transpose kernel behind sfa is JIT-compiled per number of K groups.
    return first_calls.run(DEEPGEMM, spec.NAME, ("scale layout", -(-k // spec.BLOCK)),
                           _jit_where(), convert)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it as K-major rows (unit last stride, 16-byte aligned address
    and row stride), else a fresh contiguous copy: sm_90 needs K-major operands (fp8_requires_k_major)
    and a misaligned tensor map fails to encode."""
    row_bytes = t.stride(0) * t.element_size()
    if t.stride(-1) == 1 and row_bytes % TMA_BYTES == 0 and t.data_ptr() % TMA_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _jit_where() -> str:
    cache = os.environ.get("DG_JIT_CACHE_DIR") or "~/.deep_gemm (DG_JIT_CACHE_DIR moves it)"
    return f"JIT with nvcc (NVRTC if DG_JIT_USE_NVRTC=1) into DeepGEMM's cache {cache}"


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: the scale-layout conversion."""
    (m, k), n = kwargs["a"].shape, kwargs["b"].shape[0]
    return None if m == 0 else prepare_scales(kwargs["scale_a"], kwargs["scale_b"], m, n, k)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm on fp8_gemm_nt; arguments are validated by the caller and accepted by
    supports (block scales, e4m3fn, bf16 out, no bias, K % 128 == 0, N % 8 == 0, sm_90)."""
    from deep_gemm import fp8_gemm_nt

    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=spec.OUT_DTYPES[out_dtype], device=a.device)
    if m == 0:
        return out  # fp8_gemm_nt returns early too; the scale transpose would launch an empty grid
    sfa, sfb = prepare_scales(scale_a, scale_b, m, n, k)
    lhs, rhs = _tma_ready(a), _tma_ready(b)

    def call():
        # compiled_dims "nk": N and K become compile-time constants, one kernel per weight shape
        # (the vendor's default here is "", its grouped GEMMs' "nk"; named so a default change
        # cannot alter which kernels are built).
        fp8_gemm_nt(a=(lhs, sfa), b=(rhs, sfb), d=out, c=None, recipe=RECIPE, compiled_dims="nk")

    # A compile is triggered per (N, K) and per block shape, which the heuristic picks from M too:
    # the first call of each weight shape is logged; a new M may compile again (~5 s each).
    first_calls.run(DEEPGEMM, spec.NAME, (n, k), _jit_where() + "; another M may pick another "
                    "block shape and compile again", call)
    return out
