"""The flashinfer backend's fused_moe: FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE
runner), unquantized bf16/fp16 experts on sm_89/sm_90/sm_100/sm_103/sm_110/sm_120/sm_121 and DeepSeek-V3
128-block fp8 weights (``use_deepseek_fp8_block_scale``) on sm_90. Declined everywhere until a GPU run
confirms it (``CONFIRMED``)."""

from __future__ import annotations

# What it takes, read from the flashinfer-python 0.6.14 wheel:
# - ``fused_moe/core.py`` ``cutlass_fused_moe``: keyword arguments input, token_selected_experts,
#   token_final_scales, fc1_expert_weights, fc2_expert_weights, output_dtype, quant_scales, output,
#   use_deepseek_fp8_block_scale, activation_type (``ActivationType``); it returns a list whose first
#   entry is ``output``. It raises for ``use_deepseek_fp8_block_scale`` unless the device is sm_90
#   ("FP8 block scaling not yet implemented for Blackwell") and CUDA >= 12.8; get_cutlass_fused_moe_module
#   builds modules for sm 89, 90, 100/110, 103, 120/121 only.
# - gate/up order: the activation kernels (csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh,
#   doGatedActivationKernel and doActivationKernel: ``linear_value = gemm_result[i]``,
#   ``gate_value = gemm_result[i + inter_size]``, ``fn(gate) * linear``) read GEMM1's rows 0..I-1 as up
#   and I..2I-1 as the gate: kernelmux's w1 is [gate; up], so the halves are swapped
#   (``convert_weights``, a per-call copy the bench times apart through ``metadata``).
# - activations: Swiglu = ``GLUAdaptor<SiLu>``, Geglu = ``GLUAdaptor<GELU>``, cutlass's GELU being the erf
#   one (cutlass/epilogue/thread/activation.h), as the spec's "gelu".
# - token_selected_experts int32 and token_final_scales fp32 [T, k] (flashinfer_cutlass_fused_moe_binding.cu
#   runMoe CHECK_INPUT_TYPE); the scales multiply each expert's output in fp32 (finalizeMoeRoutingKernel).
# - expert parallelism: ids outside [ep_rank * E, (ep_rank + 1) * E) are skipped by the routing
#   (``is_valid_expert = expert >= start_expert && expert < end_expert``) and by the finalize
#   (``if (expert_id < 0 || expert_id >= num_experts_per_node) continue``), which writes zeros for tokens
#   with none (enable_alltoall False). So any expert_map is served exactly by gathering the local ids on
#   the device (``expert_map[topk_ids]``, -1 off-rank) and calling with ep_size 1: no host sync.
# - alignment: runMoe checks H and I multiples of ``128 / (8 * min(activation bytes, weight bytes))``:
#   8 for 16-bit weights, 16 for fp8.
# - DeepSeek fp8 block (``getQuantParams``): quant_scales = [fc1 scales, fc2 scales], fp32, read raw
#   (no shape check), 128 x 128 blocks [E, 2I/128, H/128] / [E, H/128, I/128] row-major per expert as
#   scale_128x128_kernel writes them (fp8_blockscale_gemm_kernel.cuh). Only the bf16-activation,
#   e4m3fn-weight runner exists (CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>, block GEMM runner
#   <bf16, e4m3, bf16>). The GEMM quantizes its bf16 input itself, 1 x 128 per token
#   (scale_1x128_kernel: ``scale = amax != 0 ? 448 / amax : 1``, codes ``fp8(x * scale)``, dequant scale
#   ``1 / scale``), for the input and for the bf16 intermediate: the spec's per_group quantization up to
#   rounding (x * (448 / amax) against x / (amax / 448): a one-ulp fp8 code flip at most, inside
#   FP8_TOLERANCE) and the spec's 1e-4 amax floor (it differs only for groups with amax < 1e-4, where
#   FlashInfer keeps more precision; supports cannot see values). H and I must be multiples of 128 here
#   (the DeepSeek-V3 tiles; and a w1 scale block straddling gate and up could not be swapped).
# - fp8 per-tensor (``isFp8Quant``) takes a pre-quantized fp8 input and a *static* intermediate scale
#   (quant_scales[1], "gemm2 activation quant scale"); the spec's second quantization is dynamic (the
#   intermediate's own amax), known only inside the kernel: declined.
# - apply_router_weight_on_input: the runner has no such mode; the input is scaled by the router weight
#   in fp32 here, rounded to the hidden dtype, and the kernel gets unit final scales.
#
# Not wired: ``trtllm_bf16_moe`` / ``trtllm_fp8_block_scale_moe`` (sm_100) route inside the kernel from
# ``routing_logits`` (RoutingMethodType), so they cannot take kernelmux's topk_ids/topk_weights. Their
# ``*_routed_moe`` variants take precomputed routing only packed as ``(expert_id << 16) | bf16 weight``
# (the fp32 router weights rounded to bf16), with shuffled BlockMajorK weight layouts and a contiguous
# local_expert_offset/local_num_experts range; none of it has run here, so they wait for a GPU session.

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec

__all__ = ["CONFIRMED", "Converted", "convert_weights", "fused_moe", "metadata", "supports", "variant"]

# get_cutlass_fused_moe_module's backends ("89", "90", "100"/"110", "103", "120"/"121"; anything else raises).
CAPABILITIES = frozenset({(8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)})
BLOCK_SCALE_CAPABILITY = (9, 0)  # cutlass_fused_moe: use_deepseek_fp8_block_scale raises unless sm_90
BLOCK_SCALE_MIN_CUDA = (12, 8)  # "FP8 block scaling not implemented for CUDA 12.6 or lower."
ALIGN_16BIT = 8  # runMoe: 128 / (8 * 2 bytes)
BLOCK = spec.BLOCK  # fp8_block: H and I multiples of the 128 x 128 blocks (see the docstring)
WHERE = ("JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~); "
         "the CUTLASS MoE module takes 15-25 minutes to build")
# The variants ("bf16", "fp16", "fp8_block") confirmed against the reference on a GPU. Empty: nothing of
# this adapter has run on one yet.
CONFIRMED: frozenset[str] = frozenset()


def variant(key: spec.Key) -> str:
    """The name CONFIRMED lists this call under: "bf16", "fp16" or "fp8_block"."""
    if key.quantization == "fp8_block":
        return "fp8_block"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(key.hidden_dtype, str(key.hidden_dtype))


def _cuda_version() -> Optional[tuple[int, int]]:
    version = torch.version.cuda
    if not version:
        return None
    major, minor = (int(part) for part in version.split(".")[:2])
    return major, minor


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when cutlass_fused_moe computes calls with this key as the spec defines them, else why not."""
    capability = platform.capability
    if capability not in CAPABILITIES:
        return ("cutlass_fused_moe builds for sm_89, sm_90, sm_100, sm_103, sm_110, sm_120, sm_121, "
                f"not {platform.arch}")
    if key.quantization == "fp8_per_tensor":
        return ("no fp8_per_tensor: FlashInfer's FP8 path takes a static intermediate scale (quant_scales[1]), "
                "the spec quantizes the intermediate with its own dynamic amax")
    if key.quantization == "fp8_block":
        if capability != BLOCK_SCALE_CAPABILITY:
            return (f"fp8_block on sm_90 only (cutlass_fused_moe: \"FP8 block scaling not yet implemented "
                    f"for Blackwell\"), not {platform.arch}")
        if key.weight_dtype != torch.float8_e4m3fn:
            return f"float8_e4m3fn weights only for fp8_block (its only fp8 runner), got {key.weight_dtype}"
        if key.hidden_dtype != torch.bfloat16:
            return (f"bf16 hidden only for fp8_block (the block-scale runner is bf16 x e4m3 -> bf16), "
                    f"got {key.hidden_dtype}")
        if key.hidden_size % BLOCK or key.intermediate_size % BLOCK:
            return (f"fp8_block with H and I multiples of {BLOCK} only (DeepSeek-V3 tiles; a w1 scale block "
                    f"must not straddle gate and up, whose order is swapped), got H {key.hidden_size}, "
                    f"I {key.intermediate_size}")
        cuda = _cuda_version()
        if cuda is not None and cuda < BLOCK_SCALE_MIN_CUDA:
            return f"fp8_block needs CUDA 12.8 or newer (cutlass_fused_moe), torch has CUDA {torch.version.cuda}"
    else:
        if key.hidden_dtype not in (torch.bfloat16, torch.float16):
            return f"bf16 or fp16 only, got {key.hidden_dtype}"
        if key.hidden_size % ALIGN_16BIT or key.intermediate_size % ALIGN_16BIT:
            return (f"H and I multiples of {ALIGN_16BIT} only (runMoe's TMA alignment for 16-bit weights), "
                    f"got H {key.hidden_size}, I {key.intermediate_size}")
    if variant(key) not in CONFIRMED:
        return (f"{variant(key)}: not yet confirmed against the reference on a GPU (its JIT is a 15-25 min "
                "CUTLASS build; confirm with perf/run_gpu.sh tests-vendor)")
    return None


class Converted(NamedTuple):
    """kernelmux's experts in cutlass_fused_moe's layout: w1 with [up; gate] rows, contiguous, and
    quant_scales ([] unquantized; [w1 scales with their row blocks swapped alike, w2 scales] for fp8_block)."""

    w1: torch.Tensor
    w2: torch.Tensor
    quant_scales: list


def convert_weights(w1: torch.Tensor, w2: torch.Tensor, quantization: str,
                    w1_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor]) -> Converted:
    """The weight re-layout (a copy of w1 per call; a serving stack would do it once at load)."""
    inter = w1.shape[1] // 2
    fc1 = torch.cat((w1[:, inter:], w1[:, :inter]), dim=1)  # [gate; up] -> [up; gate], contiguous
    fc2 = w2.contiguous()
    if quantization != "fp8_block":
        return Converted(fc1, fc2, [])
    half = inter // BLOCK  # supports: I % 128 == 0, so no block straddles the two halves
    scales1 = torch.cat((w1_scale[:, half:], w1_scale[:, :half]), dim=1)
    return Converted(fc1, fc2, [scales1, w2_scale.contiguous()])


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: the weight re-layout."""
    if kwargs["hidden"].shape[0] == 0:
        return None
    return convert_weights(kwargs["w1"], kwargs["w2"], kwargs["quantization"], kwargs["w1_scale"],
                           kwargs["w2_scale"])


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    quantization: str = "none",
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's fused_moe on cutlass_fused_moe; arguments are validated by the caller and accepted
    by ``supports``."""
    num_tokens, hidden_size = hidden.shape
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    from flashinfer.fused_moe import ActivationType, cutlass_fused_moe

    converted = convert_weights(w1, w2, quantization, w1_scale, w2_scale)
    ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]  # -1: skipped by the kernel
    ids = ids.to(torch.int32).contiguous()
    if apply_router_weight_on_input:  # k == 1 (validate): x * w in fp32, then the kernel's input dtype
        x = (hidden.float() * topk_weights).to(hidden.dtype).contiguous()
        scales = torch.ones_like(topk_weights, dtype=torch.float32).contiguous()
    else:
        x = hidden.contiguous()
        scales = topk_weights.float().contiguous()
    act = ActivationType.Swiglu if activation == "silu" else ActivationType.Geglu

    def call():
        cutlass_fused_moe(
            input=x, token_selected_experts=ids, token_final_scales=scales, fc1_expert_weights=converted.w1,
            fc2_expert_weights=converted.w2, output_dtype=hidden.dtype, quant_scales=converted.quant_scales,
            output=out, use_deepseek_fp8_block_scale=quantization == "fp8_block", activation_type=act,
        )

    first_calls.run(FLASHINFER, spec.NAME, hidden.device, WHERE, call)
    return out
