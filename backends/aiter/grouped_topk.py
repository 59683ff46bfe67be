"""The aiter backend's grouped_topk: aiter's HIP grouped top-k kernels (csrc/kernels/
topk_softmax_kernels_group.cu), ``biased_grouped_topk_hip`` for DeepSeek-V3's sigmoid + bias routing and
``grouped_topk`` for routing without a bias, both writing the caller's outputs in place."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import grouped_topk as spec

__all__ = ["grouped_topk", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/ops/topk.py and topk_softmax_kernels_group.cu.
# The launcher's switch over num_expert_group (LAUNCHER2): any other count raises.
GROUPS = frozenset({1, 2, 4, 8})
# With a bias the group score (top-2 sum) is reduced over THREAD_PER_GRP = 64 / G lanes with
# lane_steps DPP steps, defined for 8, 4 and 2 lanes only: G = 8 (8 lanes) is reduced, G = 2 and
# 4 (32 and 16 lanes) keep lane 0's partial top-2; G = 1 skips group selection.
BIASED_GROUPS = frozenset({1, 8})
# One 64-lane wavefront per token (block = warp size); lane k holds the k-th pick.
MAX_TOPK = 64
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # VLLM_DISPATCH_FLOATING_TYPES


def _vector(num_experts: int) -> int:
    """Experts per vector load (LAUNCH_KERNEL: 4 when E % 4 == 0, 2 when E % 4 == 2, else 1)."""
    return 4 if num_experts % 4 == 0 else 2 if num_experts % 4 == 2 else 1


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when aiter's grouped top-k kernels compute this call as the spec defines it, else why not."""
    if key.logits_dtype not in LOGIT_DTYPES:
        return f"fp32, bf16 or fp16 logits only, got {key.logits_dtype}"
    groups = key.num_expert_group
    if groups not in GROUPS:
        return f"num_expert_group in {sorted(GROUPS)} only (the kernel launcher's switch), got {groups}"
    if key.topk > MAX_TOPK:
        return f"topk {key.topk} > {MAX_TOPK}: one wavefront per token, one lane per pick"
    group_size = key.num_experts // groups
    vector = _vector(key.num_experts)
    if group_size % vector:
        # The kernel masks excluded groups a vector at a time (group_idx = e * vec / group_size).
        return (f"{group_size} experts per group is not a multiple of the kernel's {vector}-expert vector "
                f"loads (E = {key.num_experts}): a vector would straddle two groups")
    if key.bias_dtype is not None:
        if key.scoring_func != "sigmoid":
            return "with a correction bias, sigmoid scores only (biased_grouped_topk_hip), got softmax"
        if groups not in BIASED_GROUPS:
            return (f"with a correction bias, num_expert_group 1 or 8 only: for {groups} groups the kernel reduces "
                    f"the group top-2 over {64 // groups} lanes without the cross-lane step (lane_steps 0)")
    return None


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's grouped_topk on aiter's kernels; arguments are validated by the caller and accepted
    by supports."""
    import aiter

    logits = gating_output
    num_tokens = logits.shape[0]
    weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, topk), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids  # grid(0) is not a launch
    bias = e_score_correction_bias
    if bias is not None and bias.dtype != logits.dtype:
        # The kernel reads the bias as the logits' type (reinterpret_cast<scalar_t*>): both go to
        # fp32, exactly, rather than rounding an fp32 bias to bf16.
        logits, bias = logits.float(), bias.float()
    # It reads rows at stride(0) with stride(1) == 1 (its AITER_CHECK) in vector loads that need
    # their alignment (vec_i of _vector(E) logits).
    aligned = _vector(logits.shape[1]) * logits.element_size()
    if (logits.stride(-1) != 1 or logits.data_ptr() % aligned
            or (logits.stride(0) * logits.element_size()) % aligned):
        logits = logits.clone(memory_format=torch.contiguous_format)
    variant = (logits.dtype, num_expert_group, bias is not None, scoring_func)

    if bias is not None:
        # The HIP kernel itself: aiter.biased_grouped_topk switches to moe_fused_gate for more than
        # cu_num * 212 tokens, which drops routed_scaling_factor (moe_fused_gate.cu writes
        # scores / sum) and asserts renormalization.
        def call():
            aiter.biased_grouped_topk_hip(
                gating_output=logits, correction_bias=bias.contiguous(), topk_weights=weights, topk_ids=ids,
                num_expert_group=num_expert_group, topk_grp=topk_group, need_renorm=renormalize,
                routed_scaling_factor=float(routed_scaling_factor),
            )
    else:
        def call():
            aiter.grouped_topk(
                gating_output=logits, topk_weights=weights, topk_ids=ids, num_expert_group=num_expert_group,
                topk_group=topk_group, need_renorm=renormalize, is_softmax=scoring_func == "softmax",
                routed_scaling_factor=float(routed_scaling_factor),
            )

    first_calls.run(AITER, spec.NAME, variant, WHERE + ", module_moe_asm", call)
    return weights, ids
