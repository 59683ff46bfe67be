"""The torch backend's scaled_mm: torch's own FP8 GEMM (cuBLASLt, through
``torch.nn.functional.scaled_mm``, else ``torch._scaled_mm``) for per-tensor, per-token x
per-channel and DeepSeek-V3 128-block scales, with each recipe's scale layout built here."""

# What torch takes, read from aten/src/ATen/native/cuda/ScaledBlas.cpp (2.10-2.12):
# - b as a column-major [K, N]: b.t() of the row-major [N, K] weight (_scaled_gemm: H100 takes
#   row-major x column-major only); K and N multiples of 16 (the mat1/mat2 "% 16" checks).
# - per-token x per-channel: scale_a [M, 1] and scale_b [1, N], contiguous (is_rowwise_scaling);
#   on sm_90 with cuBLAS >= 12.9 this is cuBLASLt's OUTER_VEC_32F (bf16, fp16 or fp32 out),
#   elsewhere torch's CUTLASS f8f8bf16_rowwise kernel (_scaled_rowwise_rowwise).
# - block: scale_a [M, ceil(K/128)] with strides (1, M) ("outer-dim-major", BlockWise1x128);
#   scale_b [L4, ceil(N/128)] with strides (1, L4), L4 = ceil(K/128) rounded up to 4 (cuBLAS's
#   padded 128x128 scale layout, _scaled_block1x128_block128x128); e4m3fn only
#   (check_deepseek_recipe); sm_90 only (_check_deepseek_support).
# - bias: bf16 for bf16 out, fp16 for fp16 out, none for fp32 out ("Bias is not supported when
#   out_dtype is set to Float32").

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.torch._torch_api import V2, scaled_mm_api
from kernelmux.platforms import Platform
from kernelmux.specs import scaled_mm as spec

__all__ = ["scaled_mm", "supports"]

FP8 = torch.float8_e4m3fn
BLOCK = spec.BLOCK
ALIGN = 16  # K and N: torch's "% 16" checks, and 16-byte fp8 rows for cuBLASLt
# cuBLASLt's block-scaled heuristic answered CUBLAS_STATUS_NOT_SUPPORTED for M = 1 and 9 and ran
# M = 64 and 1024 (H100, torch 2.11): block calls run on rows padded to a multiple of 16.
BLOCK_ROWS = 16
HOPPER_MAJOR = 9


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when torch's scaled mm computes calls with this key as the spec defines them, else why
    not. CUDA with fp8 (sm_89+) and the installed torch are the requirement and static check."""
    if key.fp8_dtype != FP8:
        return (f"float8_e4m3fn operands only, got {key.fp8_dtype} (e4m3fnuz is ROCm's format; "
                "cuBLASLt and torch's CUDA scaled-mm recipes take OCP e4m3fn)")
    if key.k % ALIGN or key.n % ALIGN:
        return (f"K and N multiples of {ALIGN} only (torch's _scaled_mm checks), got K {key.k}, N {key.n}")
    if key.out_dtype == "float32":
        # Measured on the H100 (torch 2.11): fp32 outputs up to 9 x 2^-14 of sum_k |a||b| off for
        # every recipe (bf16/fp16 outputs of the same products stay inside the spec's 2^-12).
        return ("bf16 or fp16 output only: cuBLASLt's fp8 GEMMs with fp32 output were up to 9 x 2^-14 "
                "sum_k |a||b| off on the H100, beyond the spec's 2^-12")
    major = platform.capability[0] if platform.capability else None
    if key.scaling == "block":
        if major != HOPPER_MAJOR:
            return (f"block scales on sm_90 only (torch's 1x128 x 128x128 recipe is cuBLASLt's, Hopper "
                    f"only: _check_deepseek_support), this is {platform.arch}")
        if key.k % BLOCK:
            return (f"block scales with K a multiple of {BLOCK} only, got K {key.k}: torch tests the "
                    "recipe on whole K groups only, a short last group is unverified")
        if scaled_mm_api() != V2 and -(-key.k // BLOCK) % 4:
            return (f"block scales with ceil(K/128) a multiple of 4 only on torch._scaled_mm (K {key.k}): "
                    "it takes the 128x128 scales unpadded while cuBLASLt reads rows padded to 4")
    if key.scaling == "channel" and key.out_dtype != "bfloat16" and major != HOPPER_MAJOR:
        return (f"per-token x per-channel scales with {key.out_dtype} output on sm_90 only (cuBLASLt); "
                f"on {platform.arch} torch runs its CUTLASS rowwise kernel, whose non-bf16 outputs and "
                "bias dtypes vary between torch versions")
    return None


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, K] fp8 as cuBLASLt reads it: unit stride along K, 16-byte aligned data and rows;
    copied only when it is not."""
    if x.stride(1) == 1 and x.stride(0) >= x.shape[1] and x.stride(0) % ALIGN == 0 and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _block_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's block scales in torch's layouts: scale_a [M, Kb] with strides (1, M); scale_b
    [Kb, Nb] K-major, its rows padded to L4 = round_up(Kb, 4) when ``padded`` (V2)."""
    rows, k_blocks = scale_a.shape
    # Strides (1, M) exactly, also for Kb = 1 (.t().contiguous().t() keeps (1, 1) there, which some
    # torch versions' stride check rejects).
    outer_major = torch.empty_strided((rows, k_blocks), (1, max(rows, 1)), dtype=torch.float32,
                                      device=scale_a.device)
    outer_major.copy_(scale_a)
    n_blocks = scale_b.shape[0]
    width = -(-k_blocks // 4) * 4 if padded else k_blocks
    k_major = scale_b.new_zeros((n_blocks, width))
    k_major[:, :k_blocks] = scale_b
    return outer_major, k_major.t()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    rows, cols = a.shape
    channels = b.shape[0]
    dtype = spec.OUT_DTYPES[out_dtype]
    if rows == 0:
        return a.new_empty((0, channels), dtype=dtype)
    layout = spec.validated_scaling(scale_a, scale_b, channels)
    a = _dense_rows(a)
    b_col_major = _dense_rows(b).t()
    # torch's epilogue adds bf16/fp16 biases with per-tensor and per-channel scales; an fp32 output
    # takes none, and block scales are not tested with one: there the bias is added here, in fp32
    # before the single output rounding, as the spec says.
    fused_bias = bias is not None and dtype != torch.float32 and layout != "block"
    gemm_dtype = dtype
    if bias is not None and not fused_bias:
        gemm_dtype = torch.float32
    elif layout == "block" and dtype == torch.float16:
        # torch tests block scales with bf16 and fp32 outputs: fp16 is rounded here from fp32.
        gemm_dtype = torch.float32
    api = scaled_mm_api()
    if layout == "tensor":
        sa, sb = scale_a, scale_b
    elif layout == "channel":
        sa, sb = scale_a.reshape(rows, 1).contiguous(), scale_b.reshape(1, channels).contiguous()
    else:
        padded_rows = -(-rows // BLOCK_ROWS) * BLOCK_ROWS
        if padded_rows != rows:  # zero rows with unit scales, sliced off below
            a = torch.cat([a, a.new_zeros((padded_rows - rows, cols))])
            scale_a = torch.cat([scale_a, scale_a.new_ones((padded_rows - rows, scale_a.shape[1]))])
        sa, sb = _block_scales(scale_a, scale_b, padded=api == V2)
    if api == V2:
        functional = torch.nn.functional
        recipes = {
            "tensor": (functional.ScalingType.TensorWise, functional.ScalingType.TensorWise),
            "channel": (functional.ScalingType.RowWise, functional.ScalingType.RowWise),
            "block": (functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128),
        }[layout]
        no_swizzle = functional.SwizzleType.NO_SWIZZLE
        out = functional.scaled_mm(a, b_col_major, sa, recipes[0], sb, recipes[1], swizzle_a=no_swizzle,
                                   swizzle_b=no_swizzle, bias=bias if fused_bias else None,
                                   output_dtype=gemm_dtype, use_fast_accum=False)
    else:
        out = torch._scaled_mm(a, b_col_major, scale_a=sa, scale_b=sb, bias=bias if fused_bias else None,
                               out_dtype=gemm_dtype, use_fast_accum=False)
    out = out[:rows]
    if bias is not None and not fused_bias:
        out = out + bias.float()
    return out if out.dtype == dtype else out.to(dtype)
