"""The xpu backend's scaled_mm: vllm-xpu-kernels' fp8_gemm (torch.ops._xpu_C.fp8_gemm, a oneDNN matmul with
source and weight scales: csrc/xpu/onednn/onednn_matmul.cpp, fp8_gemm_w8a8.h), with the scale-layout
conversion (``prepare_scales``) kept apart so the bench can time it on its own."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.xpu import XPU_KERNELS
from kernelmux.platforms import Platform
from kernelmux.specs import scaled_mm as spec

__all__ = ["Scales", "metadata", "prepare_scales", "scaled_mm", "supports"]

OUT_DTYPES = ("bfloat16", "float16")  # fp8_gemm_common: "output must be float16 or bfloat16"
WHERE = ("oneDNN creates the matmul primitive (its GPU kernel built by the driver) at the first call of "
         "each shape, cached in process memory; another M builds another")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fp8_gemm computes calls with this key as the spec defines them."""
    if key.fp8_dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn operands only (fp8_gemm takes e4m3fn or e5m2), got {key.fp8_dtype}"
    if key.out_dtype not in OUT_DTYPES:
        return f"bfloat16 or float16 output only (fp8_gemm's check), got {key.out_dtype}"
    if key.scaling == "block" and -(-key.k // spec.BLOCK) > 1 and (key.k % spec.BLOCK or key.n % spec.BLOCK):
        # fp8_gemm_w8a8.h derives the groups as K / scale_b.size(0) and N / scale_b.size(1): a short
        # last block would make them other than 128.
        return (f"block scales with K and N multiples of {spec.BLOCK} only (oneDNN's groups are K / K-blocks "
                f"and N / N-blocks), got N {key.n}, K {key.k}")
    if not key.b_layout.unit_stride:
        # ldb is one stride (fp8_gemm_w8a8.h): the weight is read as the NT view b.t() of K-contiguous
        # rows, or it would be copied at every call.
        return f"b needs a unit stride along K (read in place as the [K, N] NT weight), got {key.b_layout}"
    return None


class Scales(NamedTuple):
    """The scales in the form fp8_gemm reads them, by the branch of fp8_gemm_w8a8.h each takes."""

    a: torch.Tensor
    b: torch.Tensor


def prepare_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, layout: str, n: int) -> Scales:
    """Metadata conversion: kernelmux's canonical fp32 scales (``layout``, one of spec.LAYOUTS) as
    fp8_gemm takes them, by the branch of fp8_gemm_w8a8.h each must take.

    Per-tensor: one element each (the ``numel() == 1`` branch). Per-token x per-channel: ``[M, 1]`` and
    ``[N, 1]`` as they are (a single row or channel reads as per-tensor: the same math). Block:
    ``scale_a [M, K/128]`` as it is and ``scale_b`` transposed to ``[K/128, N/128]`` (oneDNN groups the
    ``[K, N]`` weight; the vendor's test_fp8_gemm_per_block passes it so). With a single K block
    ``scale_a`` is ``[M, 1]``, which fp8_gemm reads as per-token, so ``scale_b`` becomes the per-channel
    ``[N, 1]`` its blocks imply."""
    if layout == "tensor":
        return Scales(scale_a.reshape(1), scale_b.reshape(1))
    if layout == "channel":
        return Scales(scale_a.contiguous(), scale_b.contiguous())
    if scale_a.shape[1] == 1:
        return Scales(scale_a.contiguous(), scale_b.repeat_interleave(spec.BLOCK, dim=0)[:n].contiguous())
    return Scales(scale_a.contiguous(), scale_b.t().contiguous())


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: the scale-layout conversion."""
    a, b, scale_a, scale_b = kwargs["a"], kwargs["b"], kwargs["scale_a"], kwargs["scale_b"]
    if a.shape[0] == 0:
        return None
    return prepare_scales(scale_a, scale_b, spec.validated_scaling(scale_a, scale_b, b.shape[0]), b.shape[0])


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's scaled_mm on fp8_gemm; arguments are validated by the caller and accepted by
    ``supports``."""
    import vllm_xpu_kernels._xpu_C  # noqa: F401 - registers torch.ops._xpu_C

    (m, k), n = a.shape, b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=a.device)
    layout = spec.validated_scaling(scale_a, scale_b, b.shape[0])
    scales = prepare_scales(scale_a, scale_b, layout, n)
    # B is the [K, N] weight; b.t() is its NT view (stride(-2) == 1), no copy. A is read with one row
    # stride, and the output is laid out from A's strides (check_and_create_output_tensor): contiguous.
    lhs = a if a.is_contiguous() else a.contiguous()

    def call():
        return torch.ops._xpu_C.fp8_gemm(A=lhs, B=b.t(), out_dtype=dtype, A_scale_=scales.a, B_scale_=scales.b,
                                         bias_=bias.contiguous() if bias is not None else None)

    return first_calls.run(XPU_KERNELS, spec.NAME, (n, k, dtype, layout), WHERE, call)
