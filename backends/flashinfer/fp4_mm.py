"""The flashinfer backend's fp4_mm on mm_fp4 (W4A4, NVFP4 and MXFP4), with the conversion of the spec's
linear block scales into the 128x4 swizzled layout its kernels read (``prepare``) kept apart, so the
bench can time it on its own and a server can do it once per weight."""

from __future__ import annotations

import importlib.util
from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.backends.flashinfer.quantize_nvfp4 import WHERE, no_fp4
from kernelmux.platforms import Platform
from kernelmux.specs import fp4_mm as spec
from kernelmux.specs.quantize_nvfp4 import swizzle_128x4  # the layout get_sf_out_offset_128x4 writes
from kernelmux.specs.scaled_mm import OUT_DTYPES

__all__ = ["Prepared", "fp4_mm", "metadata", "prepare", "run", "supports"]

OUT = ("bfloat16", "float16")  # _check_mm_fp4_problem_size: "Only torch.bfloat16 and torch.float16"
# fp4_gemm_cutlass.cu (sm_100/sm_103): "Expected k/n to be divisible by 32"; cuDNN and b12x are held
# to the same so that "auto" never finds none.
MULTIPLE = 32
CUDNN_ONLY_MXFP4 = ("MXFP4: mm_fp4 runs it only through cuDNN (its cutlass and trtllm backends raise "
                    "'Only cudnn and auto FP4 GEMM supports mxfp4 quantization')")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when mm_fp4 computes this call as the spec defines it, else why not."""
    reason = no_fp4(platform, "mm_fp4")
    if reason is not None:
        return reason
    if key.mode != "w4a4":
        return ("W4A16 (bf16/fp16 activations): mm_fp4 multiplies two FP4 operands, and quantizing a first "
                "would change the result")
    if key.out_dtype not in OUT:
        return f"bfloat16 or float16 output only (mm_fp4), got {key.out_dtype}"
    if key.n % MULTIPLE or key.k % MULTIPLE:
        return (f"N and K multiples of {MULTIPLE} only (fp4_gemm_cutlass.cu checks both), got N = {key.n}, "
                f"K = {key.k}")
    if key.fmt == "mxfp4":
        if platform.capability[0] == 12:
            # _cudnn_gemm_fp4_requirement: MXFP4 on SM120/121 needs cuDNN >= 9.14, unchecked here.
            return f"{CUDNN_ONLY_MXFP4}, which needs cuDNN >= 9.14 on {platform.arch} (not checked by kernelmux)"
        if not _cudnn_installed():
            return f"{CUDNN_ONLY_MXFP4}; nvidia-cudnn-frontend (import cudnn) is not installed"
    return None


def _cudnn_installed() -> bool:
    return importlib.util.find_spec("cudnn") is not None


class Prepared(NamedTuple):
    """mm_fp4's operands: packed rows of ``a [M, K/2]`` and ``b [N, K/2]``, their swizzled scales,
    and ``alpha = 1 / (a_gs * b_gs)`` (NVFP4; None for MXFP4)."""

    a: torch.Tensor
    b: torch.Tensor
    a_descale: torch.Tensor
    b_descale: torch.Tensor
    alpha: Optional[torch.Tensor]


def _packed(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()  # CHECK_INPUT: contiguous


def prepare(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str,
    a_scale: torch.Tensor,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
) -> Prepared:
    """Metadata conversion: the spec's W4A4 operands in mm_fp4's layouts. ``b``'s part depends on
    the weight only and can be done once. NVFP4 values are ``e2m1 * sf / gs`` per operand; mm_fp4
    computes ``alpha * sum(e2m1 * sf * e2m1 * sf)``, so alpha = 1 / (a_gs * b_gs) (fp32, on the
    device, no sync)."""
    alpha = None
    if fmt == "nvfp4":
        alpha = torch.reciprocal(a_global_scale.reshape(1) * b_global_scale.reshape(1))
    return Prepared(_packed(a), _packed(b), swizzle_128x4(a_scale), swizzle_128x4(b_scale), alpha)


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: ``prepare``."""
    if kwargs["a"].shape[0] == 0:
        return None
    return prepare(kwargs["a"], kwargs["b"], kwargs["b_scale"], kwargs["fmt"], kwargs["a_scale"],
                   kwargs["b_global_scale"], kwargs["a_global_scale"])


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
    """The spec's fp4_mm on mm_fp4; arguments are validated by the caller and accepted by supports
    (W4A4, bf16/fp16 out)."""
    rows, channels = a.shape[0], b.shape[0]
    dtype = OUT_DTYPES[out_dtype]
    out = torch.empty((rows, channels), dtype=dtype, device=a.device)
    if rows == 0:
        return out
    return run(prepare(a, b, b_scale, fmt, a_scale, b_global_scale, a_global_scale), fmt, out)


def run(prepared: Prepared, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """mm_fp4 on prepared operands into ``out [M, N]`` (bf16/fp16)."""
    from flashinfer.gemm import mm_fp4

    def call():
        # b and its scales go in transposed: mm_fp4 takes b as [K/2, N] column-major and hands
        # b.T (our packed rows) to the kernel (CutlassFp4GemmRunner.forward).
        mm_fp4(a=prepared.a, b=prepared.b.T, a_descale=prepared.a_descale, b_descale=prepared.b_descale.T,
               alpha=prepared.alpha, out_dtype=out.dtype, out=out, block_size=spec.BLOCKS[fmt],
               use_nvfp4=fmt == "nvfp4", backend="auto")

    # One CUTLASS (or cuDNN graph) build per architecture and format; "auto" keeps mm_fp4's own
    # backend choice (_heuristic_func_mm_fp4).
    first_calls.run(FLASHINFER, spec.NAME, (fmt, out.dtype, out.device), WHERE, call)
    return out
