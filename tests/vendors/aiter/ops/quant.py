"""Fake aiter.ops.quant: dynamic_per_token_scaled_quant (a compiled op, in-place) with the shipped stub's
signature and its kernel's arithmetic (quant_kernels.cu): per row scale = amax * fp32(1 / fp8_max),
codes = fp8(x * (1 / scale)), the reciprocal here correctly rounded where the kernel's rcp is approximate."""
import torch

from ..jit.core import compile_ops
from ..utility import dtypes

CALLS = []


@compile_ops("module_quant", develop=True)
def dynamic_per_token_scaled_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    scales: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    shuffle_scale: bool = False,
    num_rows: torch.Tensor | None = None,
    num_rows_factor: int = 1,
) -> None:
    CALLS.append(dict(rows=input.shape[0], cols=input.shape[-1]))
    if out.dtype not in (dtypes.fp8, torch.int8):
        raise TypeError(f"fake: out must be aiter's fp8 ({dtypes.fp8}) or int8, got {out.dtype}")
    rows = input.numel() // input.shape[-1]
    if not input.is_contiguous() or not out.is_contiguous() or scales.numel() != rows or scales.dtype != torch.float32:
        raise ValueError("fake: contiguous rows, one fp32 scale per row")
    x = input.reshape(rows, -1).float()
    fp8_max = torch.tensor(torch.finfo(out.dtype).max, dtype=torch.float32)
    scale = x.abs().amax(dim=1) * (1.0 / fp8_max)
    codes = (x * (1.0 / scale)[:, None]).clamp(-fp8_max, fp8_max).to(out.dtype)
    out.copy_(codes.view(out.shape))
    scales.copy_(scale.view(scales.shape))
