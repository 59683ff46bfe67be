"""The aiter backend's scaled_mm: ``gemm_a8w8_blockscale`` (CK) for 1x128 x 128x128 block scales and
``gemm_a8w8`` (CK row-wise) for per-token x per-channel scales, per-tensor scales broadcast to
that layout on the device (``prepare_scales``, timed apart by the bench)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import scaled_mm as spec

__all__ = ["metadata", "prepare_scales", "scaled_mm", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/ops/gemm_op_a8w8.py (gemm_a8w8 -> gemm_a8w8_CK,
# gemm_a8w8_blockscale), csrc/ck_gemm_a8w8/gemm_a8w8.cu, csrc/ck_gemm_a8w8_blockscale/, and
# op_tests/test_gemm_a8w8*.py (the layouts and shapes aiter tests).
FP8 = {"e4m3fnuz": torch.float8_e4m3fnuz, "e4m3fn": torch.float8_e4m3fn}  # utility/dtypes.py per gfx
OUT = ("bfloat16", "float16")  # both: "Unsupported scales/output dtype!" for anything else
# aiter's GEMM tests use N and K multiples of 128 only (24576 x 1536, 1280 x 8192, 8192 x 1024, ...);
# other shapes may fail CK's IsSupportedArgument ("This GEMM is not supported!") or were never run.
MULTIPLE = spec.BLOCK
ALIGNMENT = 16  # CK's vector loads of the fp8 rows


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when aiter's FP8 GEMMs compute this call as the spec defines it, else why not."""
    wanted = FP8.get(platform.fp8_flavour or "")
    if key.fp8_dtype != wanted:
        # aiter.dtypes.fp8 is e4m3fnuz on gfx942 and e4m3fn on gfx950; its kernels are built for that one.
        return f"{platform.fp8_flavour} operands only on {platform.arch} (aiter's dtypes.fp8), got {key.fp8_dtype}"
    if key.out_dtype not in OUT:
        return f"bfloat16 or float16 output only (the CK dispatch), got {key.out_dtype}"
    if key.bias_dtype is not None:
        # gemm_a8w8_blockscale takes none; aiter's fp8 test of gemm_a8w8 passes none ("CK fp8 kernel set
        # bias=None", op_tests/test_gemm_a8w8.py), so its bias path is unverified for fp8.
        return "no bias (gemm_a8w8_blockscale takes none; gemm_a8w8's fp8 bias path is untested by aiter)"
    if key.n % MULTIPLE or key.k % MULTIPLE:
        return (f"N and K multiples of {MULTIPLE} only (the shapes aiter's GEMM tests cover), got N = {key.n}, "
                f"K = {key.k}")
    return None


def prepare_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, n: int,
                   scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Metadata conversion: the scales as the GEMM's raw pointers read them, contiguous fp32. Block:
    ``x_scale [M, K/128]`` and ``w_scale [N/128, K/128]`` row-major, as given. Channel: ``[M, 1]`` and
    ``[N, 1]``. Per-tensor: the two scalars broadcast to ``[M, 1]`` and ``[N, 1]`` (the same product in
    the row-wise epilogue, acc * x_scale[m] * w_scale[n])."""
    if scaling == "tensor":
        return (scale_a.reshape(1, 1).expand(m, 1).contiguous(), scale_b.reshape(1, 1).expand(n, 1).contiguous())
    return scale_a.contiguous(), scale_b.contiguous()


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: the scale layout."""
    a, b = kwargs["a"], kwargs["b"]
    scaling = spec.validated_scaling(kwargs["scale_a"], kwargs["scale_b"], b.shape[0])
    return prepare_scales(kwargs["scale_a"], kwargs["scale_b"], a.shape[0], b.shape[0], scaling)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` when CK can read it in place (unit stride, 16-byte aligned address and row stride),
    else a contiguous copy."""
    if t.stride(-1) == 1 and t.data_ptr() % ALIGNMENT == 0 and (t.stride(0) * t.element_size()) % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm on aiter's CK GEMMs; arguments are validated by the caller and accepted by
    supports (the platform's fp8, bf16/fp16 out, no bias, N and K % 128)."""
    import aiter

    m, k = a.shape
    n = b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=a.device)
    scaling = spec.validated_scaling(scale_a, scale_b, n)
    x_scale, w_scale = prepare_scales(scale_a, scale_b, m, n, scaling)
    lhs, rhs = _rows(a), _rows(b)
    if scaling == "block":
        def call():
            # Its split-K comes from aiter's tuned csv (a8w8_blockscale_tuned_gemm.csv: 61 of 6630 rows
            # split K) and cannot be asked for here; a GPU run must show those shapes within tolerance.
            return aiter.gemm_a8w8_blockscale(XQ=lhs, WQ=rhs, x_scale=x_scale, w_scale=w_scale, dtype=dtype)
    else:
        def call():
            # splitK=0: one K pass (KBatch = 2^splitK), the output rounded once; None would take the tuned
            # csv's split-K, whose combination of partial results is CK's and unverified here.
            return aiter.gemm_a8w8(XQ=lhs, WQ=rhs, x_scale=x_scale, w_scale=w_scale, bias=None, dtype=dtype,
                                   splitK=0)

    return first_calls.run(AITER, spec.NAME, (scaling, n, k), WHERE, call)
