"""The aiter backend's fp4_mm on ``aiter.gemm_a4w4`` (gfx950 asm/CK, MXFP4 W4A4), with the spec's
linear e8m0 scales and row-major weight converted to the layouts it reads (``prepare``: both scales
e8m0_shuffle'd, B shuffled to (16, 16)), so the bench can time the conversion apart."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import fp4_mm as spec

__all__ = ["Prepared", "fp4_mm", "metadata", "prepare", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/ops/gemm_op_a4w4.py gemm_a4w4, aiter/ops/shuffle.py
# (shuffle_weight, shuffle_scale), aiter/utility/fp4_utils.py (e8m0_shuffle, mxfp4_to_f32: element 2j
# in the low nibble, as the spec) and op_tests/test_gemm_a4w4.py (the layouts it tests: B shuffled
# (16, 16), both scales shuffled, bpreshuffle=True).
SHUFFLE_LAYOUT = (16, 16)
# shuffle_weight: rows % 16, packed columns % 32 bytes (K % 64).
N_MULTIPLE, K_MULTIPLE = 16, 64
# aiter's utility/dtypes.py: fp4x2 and fp8_e8m0 are these torch dtypes (uint8 on a torch without them).
FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
OUT = ("bfloat16",)  # the asm kernels write bf16 (_gemm_a4w4_asm: "Out:[M, N] bf16")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when gemm_a4w4 computes this call as the spec defines it, else why not."""
    if key.fmt != "mxfp4":
        # gemm_a4w4 takes NVFP4 (global scales) only on gfx1250 (_f4gemm_asm_dispatch).
        return f"MXFP4 only (gemm_a4w4 runs NVFP4 on gfx1250 only), got {key.fmt}"
    if key.mode != "w4a4":
        return ("W4A4 only: gemm_a4w4 multiplies two FP4 operands; quantizing bf16 activations first would "
                "change the result")
    if key.out_dtype not in OUT:
        return f"bfloat16 output only (gemm_a4w4's asm kernels), got {key.out_dtype}"
    if key.n % N_MULTIPLE or key.k % K_MULTIPLE:
        return (f"N % {N_MULTIPLE} and K % {K_MULTIPLE} only (shuffle_weight's (16, 16) tiles over packed bytes), "
                f"got N = {key.n}, K = {key.k}")
    return None


class Prepared(NamedTuple):
    """gemm_a4w4's operands: ``a [M, K/2]`` packed rows, ``b`` shuffled, both scales shuffled (rows padded
    to 256, columns to 8, by aiter's shuffle_scale), in aiter's fp4x2 and fp8_e8m0 dtypes as its
    quantizer returns them."""

    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor


def prepare(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> Prepared:
    """Metadata conversion with aiter's own shuffles (device ops): ``b`` and ``b_scale`` depend on the
    weight only, so a server can prepare them once."""
    from aiter.ops.shuffle import shuffle_weight
    from aiter.utility.fp4_utils import e8m0_shuffle

    return Prepared(
        a=a.contiguous().view(FP4X2),
        b=shuffle_weight(x=b.contiguous().view(FP4X2), layout=SHUFFLE_LAYOUT),
        a_scale=e8m0_shuffle(scale=a_scale.contiguous().view(E8M0)),
        b_scale=e8m0_shuffle(scale=b_scale.contiguous().view(E8M0)),
    )


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: prepare's shuffles."""
    if kwargs["a"].shape[0] == 0:
        return None
    return prepare(kwargs["a"], kwargs["b"], kwargs["a_scale"], kwargs["b_scale"])


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
    """The spec's fp4_mm on gemm_a4w4; arguments are validated by the caller and accepted by supports
    (MXFP4 W4A4, bf16 out)."""
    import aiter

    m, n = a.shape[0], b.shape[0]
    if m == 0:
        return torch.empty((0, n), dtype=torch.bfloat16, device=a.device)
    ops = prepare(a, b, a_scale, b_scale)

    def call():
        return aiter.gemm_a4w4(A=ops.a, B=ops.b, A_scale=ops.a_scale, B_scale=ops.b_scale, dtype=torch.bfloat16,
                               bpreshuffle=True)

    return first_calls.run(AITER, spec.NAME, ("mxfp4", n, 2 * b.shape[1]), WHERE + " (module_gemm_a4w4_asm)", call)
