"""The flashinfer backend's fused_moe: on sm_100/sm_103 FlashInfer's trtllm-gen MoE on precomputed routing
(``trtllm_bf16_routed_moe``; ``trtllm_fp8_block_scale_routed_moe`` wired and declined), elsewhere and for what
trtllm-gen does not take ``cutlass_fused_moe``. Declined everywhere until a GPU run confirms it (``CONFIRMED``)."""

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
# trtllm-gen, read from the same wheel (fused_moe/core.py, data/csrc/trtllm_fused_moe_kernel_launcher.cu,
# trtllm_fused_moe_runner.cu, fused_moe/trtllm_backend/*.cu) and FlashInfer v0.6.14's tests (19f1a41:
# tests/moe/test_trtllm_gen_routed_fused_moe.py, trtllm_gen_fused_moe_utils.py):
# - ``trtllm_bf16_moe`` / ``trtllm_fp8_block_scale_moe`` route from ``routing_logits`` inside the kernel; their
#   ``*_routed_moe`` variants take ``topk_ids`` int32 [T, k] packed as PackedScoreIdx {bf16 score; int16 idx}
#   (RoutingKernel.h): the expert id in the high 16 bits, the weight's bf16 bits in the low 16.
# - archs: init_common takes majors 10 and 12 and is_trtllm_moe_supported majors >= 10, but FlashInfer runs
#   these tests on sm_100/sm_103 only ("only guaranteed to work on SM100 and SM103 GPUs"): those two here.
# - precomputed routing: routingCustom::run hands packed ids without scores to runPostTopKPipeline (no
#   softmax or renormalization, whatever routing_method_type); an id outside [local_expert_offset,
#   local_expert_offset + local_num_experts) gets expandedIdxToPermutedIdx -1 and finalizeKernel skips it (a
#   token with none gets zeros); duplicate ids in a row race ("only one wins"). So an expert_map is served on
#   the device: local ids ``expert_map[topk_ids]`` at offset 0, each off-rank slot j the id E + j (distinct,
#   never local), num_experts E + k rounded up to 4 (Fp8BlockScaleLauncher::check_routing: num_experts % 4
#   == 0 and > top_k; routingCustom: at most 2048 experts, top_k <= 32).
# - gate/up: FlashInfer's reference (run_moe_dequant: x1 = first half, x2 = second half, act(x2) * x1) and
#   activationKernel/activationDeepSeekKernel (x1 = inPtr[i], x2 = inPtr[i + innerDim / 2], silu(x2) * x1):
#   [up; gate], as for cutlass. The SwiGLU is silu(gate) * up (the default gemm1_alpha 1, beta 0).
# - bf16 (Bf16MoeLauncher): bf16 hidden states, weights and output only; weight_layout must be BlockMajorK,
#   intermediate_size % 128. Weights as BF16Moe.prepare_static_weights_for_kernel prepares them
#   (_maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache with epilogue_tile_m 128,
#   convert_to_block_layout with 128-byte blocks): GEMM1's rows interleaved for the fused gated epilogue
#   (reorder_rows_for_gated_act_gemm: row 2i up i, row 2i + 1 gate i), then both matrices' rows shuffled in
#   blocks of 32 (get_shuffle_matrix_a_row_indices, srcToDstBlk32RowMap: row r of a block moves to 8 (r % 4)
#   + r // 4), then blocked along K by 64 bf16: [E, K / 64, M, 64] (``trtllm_weights``, a per-call copy the
#   bench times apart through ``metadata``). H % 128 as well: FlashInfer tests hidden sizes 512-7168, all
#   multiples of 128; the GEMM tiles' own limits live in the cubins' headers, which the wheel lacks.
# - bf16 numerics: the activation is fused into GEMM1's epilogue from fp32 (no bf16 gate/up), stored bf16;
#   GEMM2's per-expert outputs are bf16 (gemm2_output); finalizeKernel sums ``float(bf16 weight) * output``
#   in fp32. The packed weight moves the output by at most 2^-8 sum_j w_j |y_j|: the form and size of the
#   per-expert output rounding the spec's TOLERANCE already budgets. Emulated (this dataflow against the
#   reference, 3-20 seeds) on the spec's bf16 cases and on k = 8 batches of 64-128 tokens: 0.42-0.62 of
#   TOLERANCE; on the k = 8 batches 0.55-0.62, against 0.50-0.57 with fp32 weights: inside.
# - DeepSeek fp8 (Fp8BlockScaleLauncher, MoE::Runner::run): hidden states e4m3fn with fp32 scales [H / 128,
#   T] (check_moe), weights MajorK unshuffled (use_shuffled_weight False, as FlashInfer's routed test) with
#   kernelmux's [E, 2I / 128, H / 128] and [E, H / 128, I / 128] scales, Swiglu only (getValidConfigs checks
#   it; activationDeepSeekKernel computes silu), I % 128. GEMM1 stores gate and up as e4m3 with 1 x 128
#   scales (PermuteGemm1's output dtype is the activation dtype: gemm1_output uint8, gemm1_output_scale [2I /
#   128, padded tokens]), dequantized by activationDeepSeekKernel; the spec keeps them in bf16. Emulated, that
#   reaches 0.81-0.91 of FP8_TOLERANCE on the spec's fp8_block cases and 1.05 on DeepSeek-V3's expert at 128
#   tokens: declined (TRTLLM_FP8_GEMM1), kept wired for a spec or kernel that changes.
# - apply_router_weight_on_input: as for cutlass, x * w in fp32 (then rounded to bf16, or quantized 1 x 128
#   as the spec does) with a packed weight of 1.0 (exact in bf16).

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8

__all__ = ["CONFIRMED", "Converted", "TrtllmWeights", "convert_weights", "fused_moe", "metadata", "pack_routing",
           "supports", "trtllm_weights", "variant"]

# get_cutlass_fused_moe_module's backends ("89", "90", "100"/"110", "103", "120"/"121"; anything else raises).
CAPABILITIES = frozenset({(8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)})
BLOCK_SCALE_CAPABILITY = (9, 0)  # cutlass_fused_moe: use_deepseek_fp8_block_scale raises unless sm_90
BLOCK_SCALE_MIN_CUDA = (12, 8)  # "FP8 block scaling not implemented for CUDA 12.6 or lower."
ALIGN_16BIT = 8  # runMoe: 128 / (8 * 2 bytes)
BLOCK = spec.BLOCK  # fp8_block: H and I multiples of the 128 x 128 blocks (see the docstring)
WHERE = ("JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~); "
         "the CUTLASS MoE module takes 15-25 minutes to build")
# trtllm-gen (see the notes above): the capabilities, H and I multiple, routing limits, the weights' block
# along K (128 bytes of bf16) and the row shuffle's block (epilogue_tile_m 128).
TRTLLM_CAPABILITIES = frozenset({(10, 0), (10, 3)})
TRTLLM_ALIGN = 128
TRTLLM_MAX_TOPK = 32  # routingCustom's MaxSupportedTopExperts
TRTLLM_MAX_EXPERTS = 2048  # routingCustom's MaxSupportedExperts
BLOCK_K = 64
SHUFFLE_ROWS = 32
TRTLLM_WHERE = ("JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~), "
                "with the trtllm-gen batched-GEMM cubins and headers from flashinfer-cubin or, without it, "
                "downloaded from FlashInfer's artifact server")
TRTLLM_FP8_GEMM1 = ("trtllm_fp8_block_scale_routed_moe (DeepSeek fp8) stores GEMM1's gate and up as e4m3 with 1x128 "
                    "scales (gemm1_output, dequantized by activationDeepSeekKernel) where the spec keeps them in bf16: "
                    "emulated, that reaches 0.8-0.9 of FP8_TOLERANCE on the spec's cases and 1.05 on DeepSeek-V3's "
                    "expert at 128 tokens (cutlass_fused_moe's fp8_block runs on sm_90 only)")
# The variants confirmed against the reference on a GPU: cutlass_fused_moe's "bf16", "fp16", "fp8_block" and
# trtllm-gen's "trtllm_bf16", "trtllm_fp8_block". Empty: nothing of this adapter has run on one yet.
CONFIRMED: frozenset[str] = frozenset()


def _cutlass_variant(quantization: str, hidden_dtype: torch.dtype) -> str:
    if quantization == "fp8_block":
        return "fp8_block"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(hidden_dtype, str(hidden_dtype))


def _trtllm_reason(hidden_dtype: torch.dtype, weight_dtype: torch.dtype, quantization: str, activation: str,
                   hidden_size: int, inter_size: int, topk: int, experts: int) -> Optional[str]:
    """Why the trtllm-gen routed entry points cannot take such a call (None: they can)."""
    if quantization == "fp8_per_tensor":
        return ("no fp8_per_tensor: trtllm_fp8_per_tensor_scale_moe routes from logits only and takes static "
                "output scales")
    if hidden_dtype != torch.bfloat16:
        return f"bf16 hidden only (the trtllm-gen launchers check bf16 hidden states and output), got {hidden_dtype}"
    if quantization == "fp8_block" and weight_dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn weights only for fp8_block (check_moe), got {weight_dtype}"
    if activation != "silu":
        return (f"silu only (DeepSeek fp8 runs Swiglu only; FlashInfer tests trtllm-gen's Geglu with NvFP4 only), "
                f"got {activation!r}")
    if hidden_size % TRTLLM_ALIGN or inter_size % TRTLLM_ALIGN:
        return (f"H and I multiples of {TRTLLM_ALIGN} only (intermediate_size % 128 is checked; FlashInfer tests "
                f"such hidden sizes only), got H {hidden_size}, I {inter_size}")
    if topk > TRTLLM_MAX_TOPK or experts + topk > TRTLLM_MAX_EXPERTS:
        return (f"top_k <= {TRTLLM_MAX_TOPK} and E + k <= {TRTLLM_MAX_EXPERTS} (its routing kernels' limits), "
                f"got k {topk}, E {experts}")
    return None


def _trtllm_key_reason(key: spec.Key) -> Optional[str]:
    return _trtllm_reason(key.hidden_dtype, key.weight_dtype, key.quantization, key.activation, key.hidden_size,
                          key.intermediate_size, key.topk, key.num_experts)


def variant(key: spec.Key, platform: Platform) -> str:
    """The name CONFIRMED lists this call under: "trtllm_bf16" or "trtllm_fp8_block" where trtllm-gen takes
    it (sm_100, sm_103), else cutlass_fused_moe's "bf16", "fp16" or "fp8_block"."""
    if platform.capability in TRTLLM_CAPABILITIES and _trtllm_key_reason(key) is None:
        return "trtllm_fp8_block" if key.quantization == "fp8_block" else "trtllm_bf16"
    return _cutlass_variant(key.quantization, key.hidden_dtype)


def _cuda_version() -> Optional[tuple[int, int]]:
    version = torch.version.cuda
    if not version:
        return None
    major, minor = (int(part) for part in version.split(".")[:2])
    return major, minor


def _cutlass_reason(key: spec.Key, platform: Platform) -> Optional[str]:
    """Why cutlass_fused_moe cannot compute calls with this key as the spec defines them (None: it can)."""
    capability = platform.capability
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
        return None
    if key.hidden_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 only, got {key.hidden_dtype}"
    if key.hidden_size % ALIGN_16BIT or key.intermediate_size % ALIGN_16BIT:
        return (f"H and I multiples of {ALIGN_16BIT} only (runMoe's TMA alignment for 16-bit weights), "
                f"got H {key.hidden_size}, I {key.intermediate_size}")
    return None


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when this platform's entry (trtllm-gen on sm_100/sm_103 where it takes the call, else
    cutlass_fused_moe) computes calls with this key as the spec defines them, else why not."""
    if key.quantization in spec.FP4_MODES:
        return (f"{key.quantization} experts are not wired in this adapter yet (the vendor's fp4 MoE kernels take their own prepared weight and scale layouts, not built here; "
                "the triton and cpu backends serve them)")
    if platform.capability not in CAPABILITIES:
        return ("cutlass_fused_moe builds for sm_89, sm_90, sm_100, sm_103, sm_110, sm_120, sm_121, "
                f"not {platform.arch}")
    name = variant(key, platform)
    if name == "trtllm_fp8_block":
        return TRTLLM_FP8_GEMM1
    if name == "trtllm_bf16":
        if name not in CONFIRMED:
            return (f"{name}: not yet confirmed against the reference on a GPU (an sm_100/sm_103 one; "
                    "confirm with perf/run_gpu.sh tests-vendor)")
        return None
    reason = _cutlass_reason(key, platform)
    if reason is not None:
        if platform.capability in TRTLLM_CAPABILITIES:
            return f"trtllm-gen: {_trtllm_key_reason(key)}; cutlass_fused_moe: {reason}"
        return reason
    if name not in CONFIRMED:
        return (f"{name}: not yet confirmed against the reference on a GPU (its JIT is a 15-25 min "
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


class TrtllmWeights(NamedTuple):
    """kernelmux's experts as the trtllm-gen routed entry points take them. bf16: w1 [E, H / 64, 2I, 64] and
    w2 [E, I / 64, H, 64], rows interleaved (GEMM1) and shuffled, blocked along K; scales None. fp8_block:
    MajorK [up; gate] w1 and w2 as they are, contiguous, with their scales (w1's row blocks swapped alike)."""

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]


def _shuffled(rows: int, device: torch.device) -> torch.Tensor:
    """Source row of each row after the epilogue shuffle: within a block of 32, row r moves to 8 (r % 4) +
    r // 4, so row p holds row 4 (p % 8) + p // 8."""
    p = torch.arange(rows, device=device)
    within = p % SHUFFLE_ROWS
    return p - within + 4 * (within % 8) + within // 8


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """[E, M, K] -> [E, K / 64, M, 64], contiguous (BlockMajorK with 128-byte blocks of bf16)."""
    experts, rows, cols = w.shape
    return w.reshape(experts, rows, cols // BLOCK_K, BLOCK_K).permute(0, 2, 1, 3).contiguous()


def trtllm_weights(w1: torch.Tensor, w2: torch.Tensor, quantization: str, w1_scale: Optional[torch.Tensor],
                   w2_scale: Optional[torch.Tensor]) -> TrtllmWeights:
    """The weight re-layout for trtllm-gen (a copy per call; a serving stack would do it once at load)."""
    if quantization == "fp8_block":
        converted = convert_weights(w1, w2, quantization, w1_scale, w2_scale)
        return TrtllmWeights(converted.w1, converted.w2, *converted.quant_scales)
    inter = w1.shape[1] // 2
    device = w1.device
    gated = torch.empty(2 * inter, dtype=torch.long, device=device)
    gated[0::2] = torch.arange(inter, 2 * inter, device=device)  # up (kernelmux's second half)
    gated[1::2] = torch.arange(inter, device=device)  # gate
    rows1 = gated[_shuffled(2 * inter, device)]
    rows2 = _shuffled(w2.shape[1], device)
    return TrtllmWeights(_blocked(w1[:, rows1]), _blocked(w2[:, rows2]), None, None)


def pack_routing(topk_ids: torch.Tensor, weights: torch.Tensor, expert_map: Optional[torch.Tensor],
                 experts: int) -> tuple[torch.Tensor, int]:
    """``(id << 16) | bf16 weight bits`` int32 [T, k] with local ids (off-rank slot j: E + j, never local),
    and the num_experts to pass (local experts at offset 0). All on the device, no host sync."""
    topk = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
        spare = experts + torch.arange(topk, device=ids.device)
        ids = torch.where(ids >= 0, ids, spare)
    bits = weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # no sign extension
    packed = ((ids.to(torch.int32) << 16) | bits).contiguous()
    count = max(experts + (topk if expert_map is not None else 0), topk + 1)
    return packed, -(-count // 4) * 4


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device``; (0, 0) off CUDA."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _on_trtllm(hidden: torch.Tensor, w1: torch.Tensor, topk_ids: torch.Tensor, activation: str,
               quantization: str) -> bool:
    """Whether this call goes to trtllm-gen: its device is sm_100/sm_103 and trtllm-gen takes it."""
    if _capability(hidden.device) not in TRTLLM_CAPABILITIES:
        return False
    experts, two_inter, hidden_size = w1.shape
    return _trtllm_reason(hidden.dtype, w1.dtype, quantization, activation, hidden_size, two_inter // 2,
                          topk_ids.shape[1], experts) is None


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernel runs, for the bench to time apart: the weight re-layout."""
    if kwargs["hidden"].shape[0] == 0:
        return None
    args = (kwargs["w1"], kwargs["w2"], kwargs["quantization"], kwargs["w1_scale"], kwargs["w2_scale"])
    if _on_trtllm(kwargs["hidden"], kwargs["w1"], kwargs["topk_ids"], kwargs["activation"], kwargs["quantization"]):
        return trtllm_weights(*args)
    return convert_weights(*args)


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
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's fused_moe on trtllm-gen (sm_100/sm_103, where it takes the call) or cutlass_fused_moe;
    arguments are validated by the caller and accepted by ``supports``."""
    num_tokens, hidden_size = hidden.shape
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    if _on_trtllm(hidden, w1, topk_ids, activation, quantization):
        _trtllm(hidden, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, quantization,
                w1_scale, w2_scale, out)
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


def _trtllm(hidden, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, quantization,
            w1_scale, w2_scale, out) -> None:
    """trtllm_bf16_routed_moe or trtllm_fp8_block_scale_routed_moe into ``out`` (bf16 [T, H])."""
    from flashinfer.fused_moe import (ActivationType, Fp8QuantizationType, RoutingMethodType, WeightLayout,
                                      trtllm_bf16_routed_moe, trtllm_fp8_block_scale_routed_moe)

    experts, two_inter, _ = w1.shape
    weights = trtllm_weights(w1, w2, quantization, w1_scale, w2_scale)
    router = topk_weights
    if apply_router_weight_on_input:  # k == 1 (validate): x * w in fp32, packed weight 1.0
        x = hidden.float() * topk_weights
        router = torch.ones_like(topk_weights)
    else:
        x = hidden
    packed, num_experts = pack_routing(topk_ids, router, expert_map, experts)
    # Precomputed ids skip the routing method's pre/postprocessing; TopK names the one that has none.
    routing = dict(topk_ids=packed, num_experts=num_experts, top_k=topk_ids.shape[1], n_group=None, topk_group=None,
                   intermediate_size=two_inter // 2, local_expert_offset=0, local_num_experts=experts,
                   routed_scaling_factor=None, routing_method_type=RoutingMethodType.TopK.value, do_finalize=True,
                   activation_type=ActivationType.Swiglu.value, output=out)
    if quantization == "fp8_block":
        codes, scale = quantize_fp8(x, "per_group", BLOCK, False, "e4m3fn")  # the spec's 1x128 quantization

        def call():
            trtllm_fp8_block_scale_routed_moe(
                routing_bias=None, hidden_states=codes, hidden_states_scale=scale.t().contiguous(),
                gemm1_weights=weights.w1, gemm1_weights_scale=weights.w1_scale, gemm2_weights=weights.w2,
                gemm2_weights_scale=weights.w2_scale, use_shuffled_weight=False,
                weight_layout=WeightLayout.MajorK.value, fp8_quantization_type=Fp8QuantizationType.DeepSeekFp8,
                **routing)
    else:
        states = x.to(torch.bfloat16).contiguous()  # hidden as it is (bf16), or w * x rounded to bf16

        def call():
            trtllm_bf16_routed_moe(hidden_states=states, gemm1_weights=weights.w1, gemm2_weights=weights.w2,
                                   use_shuffled_weight=True, weight_layout=WeightLayout.BlockMajorK.value, **routing)

    first_calls.run(FLASHINFER, spec.NAME, ("trtllm-gen", hidden.device), TRTLLM_WHERE, call)
