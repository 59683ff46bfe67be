"""The flashinfer backend's grouped_topk: FlashInfer's fused_topk_deepseek, which serves DeepSeek-V3's
routing (sigmoid scores, a correction bias, renormalized weights) within its kernel's limits."""

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform
from kernelmux.specs import grouped_topk as spec

__all__ = ["grouped_topk", "supports"]

# The kernel's compute capabilities (its @supported_compute_capability) and limits (its checks).
CAPABILITIES = frozenset({(8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)})
MAX_TOPK = 8
MAX_GROUP_SIZE = 32  # experts per group when grouped
MAX_SELECTED_EXPERTS = 128  # experts in the kept groups
MAX_UNGROUPED_EXPERTS = 384
# The routing the H100 conformance run confirmed (DeepSeek-V3/R1: 256 experts, 8 groups, 4 kept, top 8;
# every named case, T 1-16384). Drawn small shapes disagreed there (another expert chosen in 1 of 2
# rows; weights 2.4e-5 relative off, the spec allows 2e-5), so the rest is declined until understood.
CONFIRMED = frozenset({(256, 8, 4, 8)})


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fused_topk_deepseek computes this call as the spec defines it, else why not."""
    if platform.capability not in CAPABILITIES:
        return f"fused_topk_deepseek runs on sm_89, sm_90, sm_100, sm_103, sm_120, sm_121, not {platform.arch}"
    if key.scoring_func != "sigmoid" or key.bias_dtype is None or not key.renormalize:
        return ("DeepSeek-V3 routing only: sigmoid scores, a correction bias, renormalized weights "
                f"(got {key.scoring_func}, bias {'given' if key.bias_dtype else 'none'}, "
                f"renormalize={key.renormalize})")
    if key.logits_dtype != torch.float32:
        # Its weights come back in the logits' dtype: a bf16 weight is 2^-9 off, the spec allows 2e-5.
        return f"fp32 logits only (the weights are returned in the logits' dtype), got {key.logits_dtype}"
    if key.topk > MAX_TOPK:
        return f"topk {key.topk} > {MAX_TOPK}, the kernel's limit"
    if key.topk_group * key.num_expert_group < key.topk:
        return (f"topk_group * num_expert_group = {key.topk_group * key.num_expert_group} < topk {key.topk}: "
                "the kernel refuses it")
    group_size = key.num_experts // key.num_expert_group
    if key.num_expert_group > 1 and group_size > MAX_GROUP_SIZE:
        return f"{group_size} experts per group > {MAX_GROUP_SIZE}, the kernel's limit"
    if key.num_expert_group > 1 and group_size * key.topk_group > MAX_SELECTED_EXPERTS:
        return (f"{group_size * key.topk_group} experts in the kept groups > {MAX_SELECTED_EXPERTS}, "
                "the kernel's limit")
    if key.num_expert_group == 1 and key.num_experts > MAX_UNGROUPED_EXPERTS:
        return f"{key.num_experts} experts in one group > {MAX_UNGROUPED_EXPERTS}, the kernel's limit"
    if (key.num_experts, key.num_expert_group, key.topk_group, key.topk) not in CONFIRMED:
        return (f"(experts, groups, kept groups, topk) = {(key.num_experts, key.num_expert_group, key.topk_group, key.topk)}"
                f" is not among those confirmed against the reference on a GPU, {sorted(CONFIRMED)}: on drawn "
                "small shapes the kernel chose other experts (H100, flashinfer 0.6.14)")
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
    """The spec's grouped_topk on fused_topk_deepseek; arguments are validated by the caller and
    accepted by supports (fp32 logits, sigmoid, a bias, renormalized)."""
    from flashinfer.fused_moe import fused_topk_deepseek

    scores = gating_output.contiguous()
    num_tokens = scores.shape[0]
    weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=scores.device)
    ids = torch.empty((num_tokens, topk), dtype=torch.int32, device=scores.device)
    if num_tokens == 0:
        return weights, ids
    bias = e_score_correction_bias.to(scores.dtype).contiguous()  # it takes the logits' dtype; fp32 is exact

    def call():
        fused_topk_deepseek(
            scores=scores, bias=bias, n_group=num_expert_group, topk_group=topk_group, topk=topk,
            routed_scaling_factor=float(routed_scaling_factor), topk_values=weights, topk_indices=ids,
        )

    first_calls.run(FLASHINFER, spec.NAME, scores.device, "JIT with nvcc into FlashInfer's cache, "
                    "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)", call)
    return weights, ids
