"""The xpu backend's fused_moe: vllm-xpu-kernels' XpuFusedMoe (fused_moe_interface.py: remap_hidden_states,
two Xe2 cutlass grouped GEMMs, silu_and_mul / gelu_and_mul, moe_gather) for 16-bit experts, with the
per-call weight re-layout to the vendor's [E, K, N] kept apart (``prepare_weights``) for the bench."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec

__all__ = ["PreparedWeights", "metadata", "fused_moe", "prepare_weights", "supports"]

# The top-k counts remap_hidden_states and moe_gather are instantiated for (their DISPATCH_TOPK_LAUNCH
# and CASE_TOPK lists); any other throws.
TOPKS = frozenset({1, 2, 4, 6, 7, 8, 10, 16})
# remap_hidden_states.cpp: local_experts_num <= EXCLUSIVE_SIZE (a local-memory counter per expert).
MAX_LOCAL_EXPERTS = 1024
# Elements: remap_hidden_states copies 16-byte vectors (hidden_size % ElemsPerItem, 8 for 16-bit), and
# the Xe2 grouped GEMM checks N % 8 == 0 (grouped_gemm_xe2_interface.hpp) for N = 2I and N = H.
ROW_MULTIPLE = 8


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when XpuFusedMoe computes calls with this key as the spec defines them."""
    if key.quantization in spec.FP4_MODES:
        return (f"{key.quantization} experts are not wired in this adapter yet (the vendor's fp4 MoE kernels take their own prepared weight and scale layouts, not built here; "
                "the triton and cpu backends serve them)")
    if key.quantization == "fp8_per_tensor":
        # Per-tensor fp8 weights run W8A16 there: the activations stay 16-bit (its test passes no
        # a1q_scale, and quant_act_xpu has no per-tensor recipe), while the spec quantizes them.
        return ("fp8_per_tensor: XpuFusedMoe runs fp8 weights with 16-bit activations (W8A16); the spec "
                "quantizes the activations per tensor")
    if key.quantization == "fp8_block":
        # Its block-fp8 recipe needs Xe2/Xe3 (the xe_default grouped GEMM drops ptr_B_scale), which the
        # platform model does not tell apart, and re-quantizes the intermediate with a 1e-10 amax floor
        # (quant_fp8_block_act) where the spec floors at 1e-4.
        return ("fp8_block: XpuFusedMoe's block-fp8 recipe runs only on Xe2/Xe3 (kernelmux's XPU platform does "
                "not tell them apart) and floors the intermediate's 1x128 amax at 1e-10, not the spec's 1e-4")
    if key.topk not in TOPKS:
        return f"topk in {sorted(TOPKS)} only (remap_hidden_states and moe_gather instances), got {key.topk}"
    if key.num_experts > MAX_LOCAL_EXPERTS:
        return f"at most {MAX_LOCAL_EXPERTS} local experts (remap_hidden_states), got {key.num_experts}"
    if key.hidden_size % ROW_MULTIPLE or (2 * key.intermediate_size) % ROW_MULTIPLE:
        return (f"H and 2I multiples of {ROW_MULTIPLE} only (16-byte row copies, the grouped GEMM's N % 8), "
                f"got H {key.hidden_size}, I {key.intermediate_size}")
    return None


class PreparedWeights(NamedTuple):
    """The experts in the vendor's layout: ``w13 [E, H, 2I]`` and ``w2 [E, I, H]``, contiguous."""

    w13: torch.Tensor
    w2: torch.Tensor


def prepare_weights(w1: torch.Tensor, w2: torch.Tensor) -> PreparedWeights:
    """Metadata conversion: kernelmux's ``w1 [E, 2I, H]`` and ``w2 [E, H, I]`` as XpuFusedMoe takes 16-bit
    experts, ``[E, K, N]`` (its constructor asserts contiguous weights; vLLM transposes them once at
    load, as the vendor's own test does). A copy of every expert: a model would prepare it once."""
    return PreparedWeights(w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous())


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernels run, for the bench to time apart: the weight re-layout."""
    if kwargs["hidden"].shape[0] == 0:
        return None
    return prepare_weights(kwargs["w1"], kwargs["w2"])


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
    """The spec's fused_moe on XpuFusedMoe; arguments are validated by the caller and accepted by
    ``supports`` (16-bit experts)."""
    num_tokens, hidden_size = hidden.shape
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    from vllm_xpu_kernels.fused_moe_interface import XpuFusedMoe

    weights = prepare_weights(w1, w2)
    if apply_router_weight_on_input:  # k == 1 (validate): x * w in fp32, rounded to the kernel's input dtype
        x = (hidden.float() * topk_weights).to(hidden.dtype)
        router = torch.ones_like(topk_weights, dtype=torch.float32)
    else:
        x = hidden.contiguous()  # remap_hidden_states reads rows at row * hidden_size
        router = topk_weights.contiguous()  # moe_gather reads [T, k] fp32 raw
    mapping = expert_map.contiguous() if expert_map is not None else None
    # A pair whose expert maps to -1 gets no remapped row (remap_hidden_states) and adds nothing in
    # moe_gather: the spec's off-rank zero. Constructing it allocates nothing for 16-bit experts.
    moe = XpuFusedMoe(
        w13=weights.w13, w13_scales=None, w13_bias=None, w2=weights.w2, w2_scales=None, w2_bias=None,
        n_experts_per_token=topk_ids.shape[1], activation=activation, num_experts=w1.shape[0], expert_map=mapping,
    )
    moe.apply(output=out, hidden_states=x, topk_weights=router, topk_ids=topk_ids.contiguous(), expert_map=mapping)
    return out
