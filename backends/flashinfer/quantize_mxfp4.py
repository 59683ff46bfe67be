"""The flashinfer backend's quantize_mxfp4 on fp4_quantize (ue8m0 scales in its linear layout): NVIDIA's
"ceil" scale rounding on bf16/fp16 input, with the spec's values restored for blocks that hold a NaN,
an Inf or only zeros."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.backends.flashinfer.quantize_nvfp4 import INPUT_DTYPES, WHERE, no_fp4
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_mxfp4 as spec
from kernelmux.specs.quantize_nvfp4 import in_scale_layout, scale_shape

__all__ = ["quantize_mxfp4", "supports"]

# cvt_warp_fp16_to_fp4 (quantization_utils.cuh) for ue8m0: d = amax * rcp(6), code =
# __nv_cvt_float_to_e8m0(d, __NV_SATFINITE, cudaRoundPosInf), i.e. 2^ceil(log2(amax / 6)): the
# spec's "ceil". (amax * rcp(6) and the spec's amax / 6 can differ in the last bit, but for a bf16
# or fp16 amax, at most 11 significant bits, neither lies within an ulp of a power of two unless
# both equal it, so the ceiling agrees.)
ROUNDING = "ceil"


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fp4_quantize computes this call as the spec defines it, else why not."""
    reason = no_fp4(platform, "fp4_quantize")
    if reason is not None:
        return reason
    if key.rounding != ROUNDING:
        return (f"rounding {key.rounding!r}: FlashInfer rounds the shared scale up, 2^ceil(log2(amax / 6)) "
                "(__nv_cvt_float_to_e8m0 with cudaRoundPosInf), the spec's 'ceil'; OCP's 'floor' it does not do")
    if key.x_dtype not in INPUT_DTYPES:
        return f"bf16 or fp16 input only (fp4_quantize), got {key.x_dtype}"
    return None


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_mxfp4 on fp4_quantize; arguments are validated by the caller and accepted
    by supports (rounding "ceil", bf16/fp16). The kernel writes linear scales (the special blocks are
    fixed in them); swizzled ones are the spec's swizzle of those."""
    from flashinfer.fp4_quantization import fp4_quantize

    rows, cols = x.shape
    blocks = cols // spec.BLOCK
    if rows == 0:
        return (torch.empty((0, cols // 2), dtype=torch.uint8, device=x.device),
                torch.empty(scale_shape(0, blocks, scale_layout), dtype=torch.uint8, device=x.device))
    # The kernel takes no strides (CHECK_CONTIGUOUS); a fresh tensor also keeps a one-row x from
    # reading as column-major (fp4_quantize transposes when stride(-2) == 1).
    source = x if x.stride() == (cols, 1) else x.clone(memory_format=torch.contiguous_format)
    result = {}

    def call():
        result["q"], result["sf"] = fp4_quantize(input=source, global_scale=None, sf_vec_size=spec.BLOCK,
                                                 sf_use_ue8m0=True, is_sf_swizzled_layout=False)

    first_calls.run(FLASHINFER, spec.NAME, (x.dtype, x.device), WHERE, call)
    q = result["q"].view(torch.uint8).reshape(rows, cols // 2)
    scale = result["sf"].view(torch.uint8).reshape(rows, blocks)
    q, scale = restore_special_blocks(source, q, scale)
    return q, in_scale_layout(scale, scale_layout)


def restore_special_blocks(x: torch.Tensor, q: torch.Tensor,
                           scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's codes and scale for the blocks the kernel treats otherwise, found from one more
    read of ``x`` (no sync; about 0.8x the quantizer's own traffic for bf16):
    a block with a NaN or an Inf gets scale 0xFF and codes 0 (the kernel's max drops NaN (__hmax)
    and saturates Inf to 0xFE); an all-zero block gets scale 0 and codes 0 (the kernel writes
    0x8 for -0.0)."""
    rows, cols = x.shape
    blocks = cols // spec.BLOCK
    amax = x.view(rows, blocks, spec.BLOCK).abs().amax(dim=-1)  # NaN propagates through amax
    nonfinite = ~torch.isfinite(amax)
    special = nonfinite | (amax == 0)
    scale = torch.where(nonfinite, torch.full_like(scale, spec.E8M0_NAN),
                        torch.where(amax == 0, torch.zeros_like(scale), scale))
    q = q.view(rows, blocks, spec.BLOCK // 2).masked_fill(special[:, :, None], 0).view(rows, cols // 2)
    return q, scale
