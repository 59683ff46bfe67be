"""The torch backend's int4_mm: KleidiAI's W4A8 kernels on Arm CPUs through torch's own ops,
``aten::_dyn_quant_pack_4bit_weight`` (the weights packed for the kernel, per call) then
``aten::_dyn_quant_matmul_4bit`` (each activation row quantized to int8 inside, the int4 GEMM)."""

# What torch takes, read from pytorch/pytorch aten/src/ATen/native/cpu/int4mm_kernel.cpp (00b919a),
# aten/src/ATen/native/kleidiai/kai_kernels.cpp (1dfb724) and kai_pack.h (05a41fc), and run on the
# installed torch 2.13.0 (x86: its reference path; tests/backends/torch/test_int4_mm.py):
# - weights: uint8 [N, K/2], element 2j in the low nibble, codes value + 8 (the spec's b); the
#   kernels read it and the scales by data pointer, so both are passed contiguous.
# - scales (can_use_kleidiai): fp32 [N, 1] when block_size == K (channelwise, qsi4cx kernels);
#   bf16 [N, K/block_size] with block_size % 32 == 0 otherwise (groupwise, qsi4c32). Other scale
#   dtypes make torch pack its slow reference path instead of KleidiAI's; groups that are not a
#   multiple of 32 are refused ("Group size should be multiple of 32").
# - bias: fp32 [N], packed with the weights and added after the scales, before the output.
#   kai_pack.h takes ``bias.to(kFloat).data_ptr()`` (and channelwise ``scales.to(kFloat)``): for any
#   other dtype a pointer into a temporary freed at once, so both are passed as fp32 already.
# - inp: fp32 or bf16 [M, K]; the bf16 path is channelwise only and truncates its output to bf16
#   (ref_dyn_quant_matmul_4bit_channelwise_kernel_bf16: bits >> 16), so kernelmux passes fp32
#   (exact for bf16 and fp16) and rounds the fp32 output once, as the spec does. The reference path
#   reads inp by data pointer as dense rows: a strided view gave wrong rows on torch 2.13 (x86).
# - the activation quantization (kai_run_lhs_quant_pack_qai8dxp_f32; torch's fallback repeats it)
#   is the spec's quantize_int8_rows, step for step; the x86 path is bit-identical to the reference
#   for fp32 outputs on every case it takes (specs/_tolerance.py, int4_mm).

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import int4_mm as spec

__all__ = ["GROUP_MULTIPLE", "int4_mm", "metadata", "pack_weights", "supports"]

GROUP_MULTIPLE = 32  # KleidiAI's qsi4c32 kernels: groups of 32k (can_use_kleidiai, the pack's check)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when torch's KleidiAI ops compute calls with this key as the spec defines them, else why
    not. aarch64 with KleidiAI and both ops in the installed torch are the requirement and static
    check; every activation dtype and layout is taken (converted to dense fp32 rows, exactly)."""
    if key.act_quant != "int8_dynamic":
        return (f"act_quant 'int8_dynamic' only (W4A8: the op quantizes activations to int8 inside), "
                f"got {key.act_quant!r}")
    if key.group_size == key.k:
        return None  # channelwise: any scale dtype widens exactly to the fp32 scales torch wants
    if key.group_size % GROUP_MULTIPLE:
        return (f"groups that are multiples of {GROUP_MULTIPLE} only (KleidiAI's qsi4c32 kernels; torch's pack "
                f"refuses others), got {key.group_size}")
    if key.scale_dtype != torch.bfloat16:
        dtype = str(key.scale_dtype).removeprefix("torch.")
        return (f"bfloat16 group scales only (KleidiAI's groupwise kernel takes bf16; torch runs {dtype} ones on "
                "its scalar reference path, and rounding them to bf16 would change the weights)")
    return None


def pack_weights(b: torch.Tensor, b_scale: torch.Tensor, group_size: int,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The spec's weights packed for KleidiAI (``_dyn_quant_pack_4bit_weight``): fp32 scales per
    channel (widened exactly from any scale dtype), bf16 per group (as given: ``supports``), an fp32
    bias. Depends on the weights only: a server would do it once per layer."""
    channels, half = b.shape
    cols = 2 * half
    scales = b_scale.float() if group_size == cols else b_scale
    return torch.ops.aten._dyn_quant_pack_4bit_weight(
        weights=b.contiguous(),
        scales_zeros=scales.contiguous(),
        bias=None if bias is None else bias.float().contiguous(),
        block_size=group_size,
        in_features=cols,
        out_features=channels,
    )


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMM, for the bench to time apart: ``pack_weights``."""
    if kwargs["a"].shape[0] == 0:
        return None
    return pack_weights(kwargs["b"], kwargs["b_scale"], kwargs["group_size"], kwargs.get("bias"))


def int4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    act_quant: str = "int8_dynamic",
) -> torch.Tensor:
    """The spec's int4_mm on torch's KleidiAI ops; arguments are validated by the caller and accepted
    by ``supports``."""
    rows, cols = a.shape
    channels = b.shape[0]
    if rows == 0:
        return a.new_empty((0, channels))
    packed = pack_weights(b, b_scale, group_size, bias)
    inp = a.to(torch.float32).contiguous()  # dense fp32 rows: exact for bf16 and fp16
    out = torch.ops.aten._dyn_quant_matmul_4bit(
        inp=inp, packed_weights=packed, block_size=group_size, in_features=cols, out_features=channels,
    )
    return out if out.dtype == a.dtype else out.to(a.dtype)
