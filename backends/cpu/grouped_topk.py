"""grouped_topk on the CPU: the spec's math reordered to do less work than the reference.

Where the reference scores all E experts, masks the dropped groups and runs top-k over E, this
selects on the logits when the scoring function is monotonic and no bias is added (softmax and
sigmoid preserve order within a row), runs top-k only over the kept groups' experts, and computes
the weights only for the k chosen experts (renormalized softmax needs no full-row sum). Small
top-k's are k passes of max() instead of torch.topk, which on CPU costs about 1 us per row
(measured: top-8 of 256 over 8192 rows, 8.5 ms with topk, see _topk_indices).
"""

from typing import Optional

import torch

# Up to this k, k passes of max() beat torch.topk on CPU rows of 8..256 (k = 8 of 256: about 4x).
_MAX_PASSES_UP_TO = 16


def _topk_indices(values: torch.Tensor, k: int, *, owned: bool) -> torch.Tensor:
    """Indices of the k largest along the last dim, in no particular order. ``owned``: ``values``
    is a temporary this function may overwrite."""
    if k > _MAX_PASSES_UP_TO or k >= values.shape[-1]:
        return values.topk(k, dim=-1, sorted=False).indices
    work = values if owned else values.clone()
    indices = torch.empty((*values.shape[:-1], k), dtype=torch.int64)
    for j in range(k):
        index = work.argmax(dim=-1, keepdim=True)
        indices[..., j : j + 1] = index
        if j + 1 < k:
            work.scatter_(-1, index, float("-inf"))
    return indices


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
    logits = gating_output.float()
    num_tokens, num_experts = logits.shape
    group_size = num_experts // num_expert_group
    bias = e_score_correction_bias

    if bias is None:
        select_on = logits  # a monotonic score function keeps each row's order
    elif scoring_func == "sigmoid":
        select_on = torch.sigmoid(logits).add_(bias.float())
    else:
        select_on = torch.softmax(logits, dim=-1).add_(bias.float())

    if 1 < num_expert_group and topk_group < num_expert_group:
        grouped = select_on.view(num_tokens, num_expert_group, group_size)
        if bias is not None:
            top2 = grouped.gather(-1, _topk_indices(grouped, 2, owned=False))
            group_scores = top2.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept = _topk_indices(group_scores, topk_group, owned=True)
        kept_experts = grouped.gather(1, kept.unsqueeze(-1).expand(-1, -1, group_size))
        flat = kept_experts.view(num_tokens, topk_group * group_size)
        local = _topk_indices(flat, topk, owned=True)
        ids = kept.gather(1, local // group_size).mul_(group_size).add_(local % group_size)
    else:
        ids = _topk_indices(select_on, topk, owned=select_on is not logits)

    chosen = logits.gather(1, ids)
    if scoring_func == "sigmoid":
        weights = chosen.sigmoid_()
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif renormalize:
        weights = torch.softmax(chosen, dim=-1)  # the full-row denominator cancels
    else:
        weights = chosen.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
    if routed_scaling_factor != 1.0:
        weights = weights.mul_(routed_scaling_factor)
    return weights, ids.to(torch.int32)
