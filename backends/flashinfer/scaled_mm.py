"""The flashinfer backend's scaled_mm for block scales: fp8_blockscale_gemm_sm90 on sm_90 and the CUTLASS
gemm_fp8_nt_groupwise on sm_100/sm_103/sm_120/sm_121, with the scale-layout conversion
(``prepare_scales``) kept apart so the bench can time it on its own."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform, probes
from kernelmux.specs import scaled_mm as spec

__all__ = ["metadata", "prepare_scales", "scaled_mm", "supports"]

SM90 = (9, 0)  # fp8_blockscale_gemm_sm90 refuses any device but sm_90/sm_90a (_match_sm_version)
# _cutlass_gemm_fp8_nt_groupwise_requirement's @supported_compute_capability([100, 103, 120, 121]).
GROUPWISE = frozenset({(10, 0), (10, 3), (12, 0), (12, 1)})
# fp8_blockscale_gemm_sm90 raises unless K % 128 == 0 and N % 64 == 0 (gemm_base.py).
SM90_K_MULTIPLE, SM90_N_MULTIPLE = spec.BLOCK, 64
# gemm_fp8_nt_groupwise: FlashInfer's own tests cover N, K multiples of 128 only
# (tests/gemm/test_groupwise_scaled_gemm_fp8.py), and kernelmux has not run it on sm_100/sm_120 yet.
GROUPWISE_MULTIPLE = spec.BLOCK
# gemm_fp8_nt_groupwise's docstring: "m should be padded to a multiple of 4".
GROUPWISE_M_MULTIPLE = 4
# mma_sm 2 (a 2-SM MMA) "is faster when number of rows (M) per group is large (>= 256)" (its docstring).
TWO_SM_MIN_M = 256
TMA_M_MULTIPLE = 4  # 16 bytes of fp32: TMA pads the MN-major activation scales' rows to this
TMA_BYTES = 16
RECIPE = (1, spec.BLOCK, spec.BLOCK)  # scale_granularity_mnk: 1 x 128 groups of a, 128 x 128 blocks of b
GROUPWISE_OUT = ("bfloat16", "float16")  # _validate_fp8_output_dtype
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"

_capability = probes.device_capability  # tests replace it to dry-run another architecture


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when FlashInfer's block-scaled GEMM computes this call exactly as the spec defines it,
    else why not."""
    capability = platform.capability
    if capability != SM90 and capability not in GROUPWISE:
        return ("fp8_blockscale_gemm_sm90 runs on sm_90, gemm_fp8_nt_groupwise on sm_100, sm_103, sm_120, "
                f"sm_121; not {platform.arch}")
    if key.scaling != "block":
        return (f"block scales only (1 x 128 groups of a, 128 x 128 blocks of b), got {key.scaling} "
                "scales")
    if key.fp8_dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn operands only, got {key.fp8_dtype}"
    if key.bias_dtype is not None:
        # Neither kernel takes a bias; adding one afterwards would round the output twice.
        return "no bias: FlashInfer's block-scaled FP8 GEMMs take none"
    if capability == SM90:
        if key.out_dtype != "bfloat16":
            # Its W8A8 path writes bf16 into the output whatever its dtype (the binding's
            # reinterpret_cast<__nv_bfloat16*>, "Output is always BF16"), though the wrapper allows fp16.
            return f"bfloat16 output only on sm_90 (the kernel always writes bf16), got {key.out_dtype}"
        if key.k % SM90_K_MULTIPLE or key.n % SM90_N_MULTIPLE:
            return (f"K % {SM90_K_MULTIPLE} == 0 and N % {SM90_N_MULTIPLE} == 0 only (fp8_blockscale_gemm_sm90 "
                    f"raises otherwise), got N = {key.n}, K = {key.k}")
        return None
    if key.out_dtype not in GROUPWISE_OUT:
        return f"bfloat16 or float16 output only (gemm_fp8_nt_groupwise), got {key.out_dtype}"
    if key.k % GROUPWISE_MULTIPLE or key.n % GROUPWISE_MULTIPLE:
        return (f"N and K multiples of {GROUPWISE_MULTIPLE} only on {platform.arch}: the shapes FlashInfer's "
                f"tests of gemm_fp8_nt_groupwise cover (not yet run by kernelmux there), got N = {key.n}, "
                f"K = {key.k}")
    return None


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def prepare_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int,
                   capability: tuple[int, int] = SM90) -> tuple[torch.Tensor, torch.Tensor]:
    """Metadata conversion: kernelmux's canonical fp32 block scales, ``scale_a [M, ceil(K/128)]`` and
    ``scale_b [ceil(N/128), ceil(K/128)]``, in the layouts the kernel for ``capability`` reads.

    sm_90 (fp8_blockscale_gemm_sm90, which reads raw pointers and ignores strides): ``sfa`` MN-major
    and TMA-aligned, element (m, g) at ``g * round_up(M, 4) + m`` (the layout its own activation
    quantizer writes, scale_1x128_kernel), returned as a ``[M, ceil(K/128)]`` view of that buffer;
    ``sfb`` row-major ``[ceil(N/128), ceil(K/128)]``, as its kernel indexes it.
    sm_100/sm_120 (gemm_fp8_nt_groupwise, scale_major_mode "K"): CUTLASS's K-major blockwise layouts,
    i.e. the canonical ones, contiguous, with ``sfa``'s rows padded to the M the adapter pads ``a`` to
    (a multiple of 4). ``sfb`` depends on the weight only: it can be prepared once and kept."""
    groups = scale_a.shape[1]
    sfb = scale_b.contiguous()
    if capability == SM90:
        rows = _round_up(m, TMA_M_MULTIPLE)
        buffer = torch.zeros((groups, rows), dtype=torch.float32, device=scale_a.device)
        buffer[:, :m] = scale_a.T
        return buffer.T[:m], sfb
    rows = _round_up(m, GROUPWISE_M_MULTIPLE)
    if rows == m and scale_a.is_contiguous():
        return scale_a, sfb
    sfa = torch.zeros((rows, groups), dtype=torch.float32, device=scale_a.device)
    sfa[:m] = scale_a
    return sfa, sfb


def _packed(t: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """``t`` as the kernels read it: packed rows (they take no strides, only a pointer) at a 16-byte
    aligned address (TMA), with ``rows`` rows (zero rows added); ``t`` itself when it already is."""
    rows = t.shape[0] if rows is None else rows
    if rows == t.shape[0] and t.is_contiguous() and t.data_ptr() % TMA_BYTES == 0:
        return t
    packed = torch.zeros((rows, t.shape[1]), dtype=t.dtype, device=t.device)
    packed[: t.shape[0]] = t
    return packed


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: the scale-layout conversion."""
    if kwargs["a"].shape[0] == 0:
        return None
    return prepare_scales(kwargs["scale_a"], kwargs["scale_b"], kwargs["a"].shape[0], _capability(kwargs["a"].device))


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm on FlashInfer's block-scaled FP8 GEMM for the device's architecture;
    arguments are validated by the caller and accepted by supports."""
    m, k = a.shape
    n = b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=a.device)
    capability = _capability(a.device)
    sfa, sfb = prepare_scales(scale_a, scale_b, m, capability)
    if capability == SM90:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        lhs, rhs = _packed(a), _packed(b)
        out = torch.empty((m, n), dtype=dtype, device=a.device)

        def call():
            fp8_blockscale_gemm_sm90(input=lhs, weight=rhs, input_scale=sfa, weight_scale=sfb, out=out,
                                     out_dtype=dtype)

        # One module build (~100 s on the H100), then a kernel per (N, K) and block shape.
        first_calls.run(FLASHINFER, spec.NAME, ("fp8_blockscale_gemm_sm90", n, k), WHERE, call)
        return out

    from flashinfer.gemm import gemm_fp8_nt_groupwise

    rows = _round_up(m, GROUPWISE_M_MULTIPLE)
    lhs, rhs = _packed(a, rows), _packed(b)
    out = torch.empty((rows, n), dtype=dtype, device=a.device)

    def call():
        gemm_fp8_nt_groupwise(a=lhs, b=rhs, a_scale=sfa, b_scale=sfb, scale_major_mode="K",
                              mma_sm=2 if m >= TWO_SM_MIN_M else 1, scale_granularity_mnk=RECIPE, out=out,
                              backend="cutlass")

    first_calls.run(FLASHINFER, spec.NAME, ("gemm_fp8_nt_groupwise", a.device), WHERE, call)
    return out[:m]

