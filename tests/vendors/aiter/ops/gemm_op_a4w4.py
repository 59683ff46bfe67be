"""Fake aiter.ops.gemm_op_a4w4: gemm_a4w4 (a torch_compile_guard op) with the shipped signature, its
host checks (gfx942 refused) and the layouts its asm kernels read: A row-major fp4x2, B shuffled to
(16, 16), both e8m0 scales shuffled (shuffle_scale), unshuffled here from the layouts' index formulas."""
import torch
from torch import Tensor

from ..jit.utils.chip_info import get_gfx
from ..jit.utils.torch_guard import torch_compile_guard
from ..utility import dtypes
from .shuffle import unshuffle_scale, unshuffle_weight

CALLS = []
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequant(packed, scale):
    """fp64 [R, K] of packed e2m1 pairs (element 2j low nibble) times 2^(code - 127) per 32 (255: NaN)."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    values = torch.stack((table[low], table[high]), dim=-1).reshape(packed.shape[0], -1)
    code = scale.long()
    factor = torch.where(code == 255, torch.nan, torch.exp2(code.double() - 127))
    return values * factor.repeat_interleave(32, dim=1)


@torch_compile_guard()
def gemm_a4w4(
    A: Tensor,
    B: Tensor,
    A_scale: Tensor,
    B_scale: Tensor,
    bias: Tensor | None = None,
    dtype: torch.dtype = dtypes.bf16,
    alpha: float | None = 1.0,
    beta: float | None = 0.0,
    bpreshuffle: bool | None = True,
    apreshuffle: bool | None = False,
    global_A_scale: Tensor | None = None,
    global_B_scale: Tensor | None = None,
) -> torch.Tensor:
    CALLS.append(dict(m=A.shape[0], n=B.shape[0], bpreshuffle=bpreshuffle))
    if get_gfx() == "gfx942":
        raise RuntimeError("A4W4 GEMM kernel is not supported on gfx942, but got gfx942!")
    if global_A_scale is not None or global_B_scale is not None or bias is not None or apreshuffle:
        raise NotImplementedError("fake: MXFP4 with a shuffled B only (NVFP4 is gfx1250's)")
    if not bpreshuffle or not getattr(B, "is_shuffled", False):
        raise AssertionError("fake: B must come from shuffle_weight(layout=(16, 16)) with bpreshuffle=True")
    if A.dtype != dtypes.fp4x2 or B.dtype != dtypes.fp4x2:
        raise TypeError(f"fake: A and B in aiter's fp4x2 ({dtypes.fp4x2}), got {A.dtype}, {B.dtype}")
    if A_scale.dtype != dtypes.fp8_e8m0 or B_scale.dtype != dtypes.fp8_e8m0:
        raise TypeError(f"fake: e8m0 scales ({dtypes.fp8_e8m0}), got {A_scale.dtype}, {B_scale.dtype}")
    if dtype != torch.bfloat16 or (alpha is not None and alpha != 1.0) or (beta is not None and beta != 0.0):
        raise NotImplementedError("fake: bf16 output, alpha 1, beta 0 modelled")
    (m, half), n = A.shape, B.shape[0]
    blocks = 2 * half // 32
    for name, scale, rows in (("A_scale", A_scale, m), ("B_scale", B_scale, n)):
        if scale.shape != (-(-rows // 256) * 256, -(-blocks // 8) * 8):
            raise ValueError(f"fake: {name} shuffled, rows padded to 256 and columns to 8, got {tuple(scale.shape)}")
    if not A.is_contiguous():
        raise RuntimeError("fake: A.view(m, k // 2) needs packed rows")
    a = _dequant(A.view(torch.uint8), unshuffle_scale(A_scale, m, blocks))
    b = _dequant(unshuffle_weight(B).view(torch.uint8), unshuffle_scale(B_scale, n, blocks))
    return (a @ b.T).to(dtype)
