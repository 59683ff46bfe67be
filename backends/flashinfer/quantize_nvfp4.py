"""The flashinfer backend's quantize_nvfp4 on fp4_quantize (linear scales). Wired and declined: FlashInfer
computes the block and element scales with approximate reciprocals, so its codes are not the spec's
bit for bit. Also the FP4 capability test the flashinfer FP4 entries share."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform
from kernelmux.specs import quantize_nvfp4 as spec

__all__ = ["ARITHMETIC", "CAPABILITIES", "no_fp4", "quantize_nvfp4", "supports"]

# FlashInfer's FP4 conversion (cvt_warp_fp16_to_fp4, quantization_utils.cuh) is compiled only for
# __CUDA_ARCH__ >= 1000 (cvt.rn.satfinite.e2m1x2.f32) and returns 0 below, and mm_fp4's backends
# are @supported_compute_capability([100, 103, 110, 120, 121]); the platform model knows these four.
CAPABILITIES = frozenset({(10, 0), (10, 3), (12, 0), (12, 1)})
INPUT_DTYPES = (torch.bfloat16, torch.float16)  # fp4_quantize: "only supports ... fp16/bf16/e4m3"
# cvt_warp_fp16_to_fp4 (quantization_utils.cuh), default (fast-math) path:
#   sf = e4m3(gs * (amax * rcp.approx(6))), element scale = rcp.approx(sf * rcp.approx(gs));
# with FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH: sf = e4m3(amax * (gs * (1/6))), 1 / (sf * (1 / gs)).
# The spec rounds (gs * amax) / 6 and gs / sf; a last-bit difference moves a code across an e2m1
# rounding boundary for about one element in a million (and FLASHINFER_NVFP4_4OVER6 changes the
# recipe altogether), while the spec requires every code and scale bit for bit.
ARITHMETIC = ("FlashInfer's NVFP4 quantizer computes the block scale as gs * (amax * rcp(6)) and the element "
              "scale as rcp(sf * rcp(gs)) with approximate reciprocals (quantization_utils.cuh "
              "cvt_warp_fp16_to_fp4), not the spec's (gs * amax) / 6 and gs / sf: codes near a rounding "
              "boundary differ, and the spec requires them bit for bit")
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"


def no_fp4(platform: Platform, what: str) -> Optional[str]:
    """Why ``platform`` cannot run FlashInfer's FP4 kernel ``what``, or None."""
    if platform.capability in CAPABILITIES:
        return None
    return (f"{what} runs on sm_100, sm_103, sm_120, sm_121 only (FP4 MMA and e2m1 conversion), not "
            f"{platform.arch}")


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """Always a reason: the hardware, the input dtype, else the arithmetic (ARITHMETIC)."""
    reason = no_fp4(platform, "fp4_quantize")
    if reason is not None:
        return reason
    if key.x_dtype not in INPUT_DTYPES:
        return f"bf16 or fp16 input only (fp4_quantize), got {key.x_dtype}"
    return ARITHMETIC


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's quantize_nvfp4 on fp4_quantize with linear scales (kept wired for when the recipes
    agree; supports declines it today): the global scale as the spec computes it, the kernel's
    codes and scales, and the spec's codes for blocks whose scale is 0; swizzled scales by the spec's
    swizzle of those."""
    from flashinfer.fp4_quantization import fp4_quantize

    rows, cols = x.shape
    if global_scale is None:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        # A tensor numerator, as the spec: ``float / tensor`` would be reciprocal-then-multiply.
        gs = torch.where(amax > 0, torch.full_like(amax, spec.GLOBAL_NUMERATOR) / amax, torch.ones_like(amax))
    else:
        gs = global_scale.float().reshape(()).clone()
    if rows == 0:
        return (torch.empty((0, cols // 2), dtype=torch.uint8, device=x.device),
                torch.empty(spec.scale_shape(0, cols // spec.BLOCK, scale_layout), dtype=torch.float8_e4m3fn,
                            device=x.device), gs)
    # The kernel takes no strides (CHECK_CONTIGUOUS); a fresh tensor also keeps a one-row x from
    # reading as column-major (fp4_quantize transposes when stride(-2) == 1).
    source = x if x.stride() == (cols, 1) else x.clone(memory_format=torch.contiguous_format)
    result = {}

    def call():
        result["q"], result["sf"] = fp4_quantize(input=source, global_scale=gs.reshape(1),
                                                 sf_vec_size=spec.BLOCK, sf_use_ue8m0=False,
                                                 is_sf_swizzled_layout=False)

    first_calls.run(FLASHINFER, spec.NAME, (x.dtype, x.device), WHERE, call)
    q = result["q"].view(torch.uint8).reshape(rows, cols // 2)
    sf = result["sf"].view(torch.uint8).reshape(rows, cols // spec.BLOCK)
    # A block whose sf is 0 gets codes 0 in the spec; the kernel multiplies by 0 (all zero: -0.0
    # gives code 0x8) or by rcp(0) = inf (tiny blocks: saturated codes).
    zero = (sf == 0)[:, :, None]
    q = q.view(rows, cols // spec.BLOCK, spec.BLOCK // 2).masked_fill(zero, 0).view(rows, cols // 2)
    return q, spec.in_scale_layout(sf.view(torch.float8_e4m3fn), scale_layout), gs
