"""The xpu backend's grouped_topk: vllm-xpu-kernels' fused grouped top-k (torch.ops._moe_C.grouped_topk,
csrc/moe/grouped_topk.cpp), which scores, selects groups and experts, renormalizes and scales in one
kernel; softmax routing and 16-bit logits are scored in fp32 on the device first."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import grouped_topk as spec

__all__ = ["grouped_topk", "supports"]

# grouped_topk.cpp's host checks: n_group <= 32 ("for now") and topk <= 32 (one sub-group selects
# the experts: WarpSelect<capacity WARP_SIZE>).
MAX_GROUPS = 32
MAX_TOPK = 32
# Its scoring_func: SCORING_NONE (the scores are used as given) or SCORING_SIGMOID; no softmax.
SCORING_NONE, SCORING_SIGMOID = 0, 1


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the vendor kernel computes calls with this key as the spec defines them."""
    if key.num_expert_group > MAX_GROUPS:
        return f"num_expert_group <= {MAX_GROUPS} only (grouped_topk.cpp's check), got {key.num_expert_group}"
    if key.topk > MAX_TOPK:
        return f"topk <= {MAX_TOPK} only (grouped_topk.cpp's check), got {key.topk}"
    if key.num_experts // key.num_expert_group < 2:
        # topk_with_k2_biased sums a group's top two; with one expert the second is -inf, every group
        # scores -inf and the kernel writes ids 0..k-1 with weights 1/k instead of routing.
        return "groups of at least 2 experts only (the kernel's group score is a top-2 sum: -inf for one expert)"
    if key.bias_dtype is None and key.topk_group < key.num_expert_group:
        # The kernel always scores a group by the sum of its top-2 biased scores (the bias is not
        # optional); without a bias the spec scores it by its max, which picks other groups.
        return ("without a correction bias only when every group is kept (topk_group == num_expert_group): "
                "the kernel scores groups by their top-2 sum, the spec by their max")
    return None


def _on(device: torch.device):
    # The binding allocates its outputs on torch::kXPU (the current device) and launches on the
    # current device's queue (vllmGetQueue()), with no device guard of its own.
    return torch.xpu.device(device) if device.type == "xpu" else contextlib.nullcontext()


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
    """The spec's grouped_topk on _moe_C.grouped_topk; arguments are validated by the caller and
    accepted by ``supports``."""
    import vllm_xpu_kernels._moe_C  # noqa: F401 - registers torch.ops._moe_C

    num_tokens, num_experts = gating_output.shape
    device = gating_output.device
    if num_tokens == 0:
        return (torch.empty((0, topk), dtype=torch.float32, device=device),
                torch.empty((0, topk), dtype=torch.int32, device=device))
    if scoring_func == "sigmoid" and gating_output.dtype == torch.float32:
        # The kernel's sigmoid (0.5 tanh(x/2) + 0.5 in fp32) on fp32 logits.
        scores, scoring = gating_output.contiguous(), SCORING_SIGMOID
    else:
        # The kernel has no softmax, and it computes in the logits' dtype (a bf16 score is 2^-9 off,
        # the spec allows 2e-5): score in fp32 here and hand it the scores as they are.
        logits = gating_output.float()
        probabilities = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
        scores, scoring = probabilities.contiguous(), SCORING_NONE
    # It reads raw rows of scores and bias (no stride arguments); a zero bias leaves the scores as
    # they are, and supports took bias-free calls only where group scores do not matter.
    if e_score_correction_bias is None:
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
    else:
        bias = e_score_correction_bias.contiguous()  # fp32/bf16/fp16: widened to fp32 exactly in the kernel
    with _on(device):
        weights, ids = torch.ops._moe_C.grouped_topk(
            scores=scores, n_group=num_expert_group, topk_group=topk_group, topk=topk, renormalize=renormalize,
            routed_scaling_factor=float(routed_scaling_factor), bias=bias, scoring_func=scoring,
        )
    return weights, ids
