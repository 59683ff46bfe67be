"""The xpu backend's quantize_mxfp4 on vllm-xpu-kernels' per_token_group_quant_mxfp4 (csrc/quantization/fp4/
mxfp4_quant.h). Wired and declined: its element rounding sends ties down and its zero blocks get an
eps-derived scale, so codes and scales are not the spec's bit for bit (``DECLINED``)."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import quantize_mxfp4 as spec
from kernelmux.specs.quantize_nvfp4 import in_scale_layout

__all__ = ["DECLINED", "EPS", "quantize_mxfp4", "supports"]

# mxfp4_quant.h: float_to_fp4_e2m1 counts (a > midpoint), so a value exactly on a midpoint rounds toward
# zero (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3), where the spec rounds half to even (-> 1, 2, 4), and a
# -0.0 gets code 0 (its sign is x < 0); the scale is 2^ceil(log2(max(amax, eps) / 6)) through
# sycl::log2 / exp2 (the spec's default is OCP's floor rule; its "ceil" is exact on the fp32 bits),
# and an all-zero block gets that eps-derived scale, not the spec's code 0.
DECLINED = ("per_token_group_quant_mxfp4 rounds e2m1 ties toward zero (the spec: half to even), gives -0.0 code "
            "0, and derives the block scale as 2^ceil(log2(max(amax, eps) / 6)) (all-zero blocks get an "
            "eps-derived scale, not code 0; OCP's floor rule is not offered): not the spec's bits")
EPS = 1e-10  # the vendor's own callers' eps (moe_utils.py _quant_mxfp4_act_xpu)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """Always the reason (also the entry's static check): the arithmetic differs from the spec's."""
    return DECLINED


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_mxfp4 on per_token_group_quant_mxfp4 (kept wired for when the arithmetic
    agrees; declined today): the kernel's fp32 power-of-two scales turned into e8m0 codes (their
    exponent bits)."""
    import vllm_xpu_kernels._C  # noqa: F401 - registers torch.ops._C

    rows, cols = x.shape
    q = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows, cols // spec.BLOCK), dtype=torch.float32, device=x.device)
    torch.ops._C.per_token_group_quant_mxfp4(input=x.contiguous(), output_q=q, output_s=scale,
                                             group_size=spec.BLOCK, eps=EPS)
    codes = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # 2^e is exponent field e + 127
    return q, in_scale_layout(codes, scale_layout)
