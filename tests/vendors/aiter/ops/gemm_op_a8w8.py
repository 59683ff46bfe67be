"""Fake aiter.ops.gemm_op_a8w8: gemm_a8w8 and gemm_a8w8_blockscale (torch_compile_guard ops) with the
shipped signatures and the CK kernels' checks (csrc/ck_gemm_a8w8*): operands in aiter's fp8, rows at
stride(-2) with a unit last stride, fp32 scales read through raw pointers (contiguous), bf16/fp16 out."""
import torch
from torch import Tensor

from ..jit.utils.torch_guard import torch_compile_guard
from ..utility import dtypes

CALLS = []


def _operands(XQ, WQ, x_scale, w_scale, dtype):
    if XQ.dtype != dtypes.fp8 or WQ.dtype != XQ.dtype:
        raise TypeError(f"Weights and activations should both be int8/fp8! (fake: aiter's fp8 is {dtypes.fp8}, "
                        f"got {XQ.dtype}, {WQ.dtype})")
    if x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise TypeError("Scales should have the same dtype! (fake: fp32 modelled)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"Unsupported scales/output dtype! {dtype}")
    if XQ.stride(-1) != 1 or WQ.stride(-1) != 1:
        raise RuntimeError("fake: CK reads K-contiguous rows at stride(-2)")
    if not x_scale.is_contiguous() or not w_scale.is_contiguous():
        raise RuntimeError("fake: the scales are read through raw pointers")
    if XQ.shape[1] != WQ.shape[1]:
        raise ValueError(f"K: {XQ.shape[1]} vs {WQ.shape[1]}")


@torch_compile_guard()
def gemm_a8w8(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    dtype: torch.dtype = dtypes.bf16,
    splitK: int | None = None,
) -> Tensor:
    CALLS.append(dict(op="gemm_a8w8", splitK=splitK, bias=bias is not None))
    _operands(XQ, WQ, x_scale, w_scale, dtype)
    m, n = XQ.shape[0], WQ.shape[0]
    if x_scale.numel() != m or w_scale.numel() != n:
        raise ValueError(f"fake: row-wise scales of {m} and {n} elements, got {tuple(x_scale.shape)}, "
                         f"{tuple(w_scale.shape)}")
    if bias is not None and bias.dtype != dtype:
        raise TypeError("Out amd bias should have the same dtype!")
    acc = XQ.double() @ WQ.double().T
    out = acc * x_scale.double().reshape(m, 1) * w_scale.double().reshape(1, n)
    if bias is not None:
        out = out + bias.double().reshape(1, n)
    return out.to(dtype)


@torch_compile_guard()
def gemm_a8w8_blockscale(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    dtype: torch.dtype = dtypes.bf16,
    isBpreshuffled: bool = False,
) -> torch.Tensor:
    CALLS.append(dict(op="gemm_a8w8_blockscale", preshuffled=isBpreshuffled))
    if isBpreshuffled:
        raise NotImplementedError("fake: the preshuffled asm path is not modelled")
    _operands(XQ, WQ, x_scale, w_scale, dtype)
    (m, k), n = XQ.shape, WQ.shape[0]
    if x_scale.shape != (m, -(-k // 128)) or w_scale.shape != (-(-n // 128), -(-k // 128)):
        raise ValueError(f"fake: x_scale [M, K/128] and w_scale [N/128, K/128] row-major, got "
                         f"{tuple(x_scale.shape)}, {tuple(w_scale.shape)}")
    a = XQ.double() * x_scale.double().repeat_interleave(128, dim=1)[:, :k]
    b = WQ.double() * w_scale.double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    return (a @ b.T).to(dtype)
