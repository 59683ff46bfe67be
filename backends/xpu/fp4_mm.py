"""The xpu backend's fp4_mm: vllm-xpu-kernels' fp4_gemm (torch.ops._xpu_C.fp4_gemm, a oneDNN MXFP4 W4A4 matmul:
csrc/xpu/onednn/onednn_matmul.cpp, fp4_gemm_w4a4.h), on zero-copy dtype views of kernelmux's packed
codes and e8m0 scale codes."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.xpu import XPU_KERNELS
from kernelmux.platforms import Platform
from kernelmux.specs import fp4_mm as spec

__all__ = ["fp4_mm", "supports"]

OUT_DTYPES = ("bfloat16", "float16")  # fp4_gemm: "output must be float16 or bfloat16"
WHERE = ("oneDNN creates the matmul primitive (its GPU kernel built by the driver) at the first call of "
         "each shape, cached in process memory; another M builds another")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fp4_gemm computes calls with this key as the spec defines them."""
    if key.fmt != "mxfp4":
        # dnnl_matmul_w4a4_fp4 asserts float8_e8m0fnu scales ("Unsupported scale type for fp4 matmul").
        return f"MXFP4 only (fp4_gemm takes e8m0 block scales of 32; no NVFP4 GEMM in the library), got {key.fmt}"
    if key.mode != "w4a4":
        # fp4_gemm wants both operands float4_e2m1fn_x2; the library's 16-bit-activation GEMM is int4.
        return "W4A4 only (fp4_gemm takes packed e2m1 activations; there is no MXFP4 W4A16 GEMM), got w4a16"
    if key.out_dtype not in OUT_DTYPES:
        return f"bfloat16 or float16 output only (fp4_gemm's check), got {key.out_dtype}"
    if not key.b_layout.unit_stride:
        return f"b needs a unit stride along K (read in place as the [K/2, N] NT weight), got {key.b_layout}"
    return None


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
    """The spec's fp4_mm on fp4_gemm; arguments are validated by the caller and accepted by ``supports``
    (MXFP4 W4A4)."""
    import vllm_xpu_kernels._xpu_C  # noqa: F401 - registers torch.ops._xpu_C

    m, n = a.shape[0], b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=a.device)
    # Same bytes, the vendor's dtypes: e2m1 pairs with element 2j in the low nibble (torch's
    # float4_e2m1fn_x2, as moe_utils.py unpacks them) and e8m0 codes 2^(c - 127).
    lhs = (a if a.is_contiguous() else a.contiguous()).view(torch.float4_e2m1fn_x2)
    weight = b.view(torch.float4_e2m1fn_x2).t()  # [K/2, N], stride(-2) == 1: the NT weight, no copy
    # Both scale tensors row-major as kernelmux has them: [M, K/32] for A, [N, K/32] for B, as the
    # vendor's test_mxfp4_gemm passes them (fp4_gemm checks they are contiguous).
    a_codes = a_scale.contiguous().view(torch.float8_e8m0fnu)
    b_codes = b_scale.contiguous().view(torch.float8_e8m0fnu)

    def call():
        return torch.ops._xpu_C.fp4_gemm(A=lhs, B=weight, A_scale=a_codes, B_scale=b_codes, out_dtype=dtype,
                                         bias_=None)

    return first_calls.run(XPU_KERNELS, spec.NAME, (n, b.shape[1] * 2, dtype), WHERE, call)
