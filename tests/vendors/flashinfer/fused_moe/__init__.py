"""Fake flashinfer.fused_moe (0.6.14): fused_topk_deepseek with the shipped signature, argument checks
and output layouts, DeepSeek-V3 routing as its docstring defines it, written here independently."""
import torch

CALLS = []


def fused_topk_deepseek(scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values,
                        topk_indices, launch_with_pdl=True, routing_replay_out=None):
    CALLS.append(dict(n_group=n_group, topk_group=topk_group, topk=topk, scale=routed_scaling_factor))
    tokens, experts = scores.shape
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not scores.is_contiguous():
        raise TypeError(f"scores: {scores.dtype}, contiguous={scores.is_contiguous()}")
    if bias.shape != (experts,) or bias.dtype != scores.dtype or not bias.is_contiguous():
        raise TypeError(f"bias: {tuple(bias.shape)} {bias.dtype}")
    if topk_values.shape != (tokens, topk) or topk_values.dtype != scores.dtype:
        raise TypeError(f"topk_values: {tuple(topk_values.shape)} {topk_values.dtype}")
    if topk_indices.shape != (tokens, topk) or topk_indices.dtype != torch.int32:
        raise TypeError(f"topk_indices: {tuple(topk_indices.shape)} {topk_indices.dtype}")
    if topk_group * n_group < topk or topk_group > n_group or topk > 8:
        raise ValueError("Invalid configuration")
    if n_group > 1 and (experts / n_group > 32 or experts / n_group * topk_group > 128):
        raise ValueError("Invalid configuration for n_group > 1")
    if n_group == 1 and experts > 384:
        raise ValueError("Invalid configuration for n_group = 1")
    sig = torch.sigmoid(scores.double())
    biased = sig + bias.double()
    size = experts // n_group
    group_score = biased.view(tokens, n_group, size).sort(dim=-1, descending=True).values[..., :2].sum(-1)
    keep = torch.zeros(tokens, n_group, dtype=torch.bool)
    keep.scatter_(1, group_score.sort(dim=-1, descending=True).indices[:, :topk_group], True)
    masked = biased.masked_fill(~keep.repeat_interleave(size, dim=1), -1.0e300)
    chosen = masked.sort(dim=-1, descending=True).indices[:, :topk]
    picked = sig.gather(1, chosen)
    topk_values.copy_(picked / picked.sum(-1, keepdim=True) * routed_scaling_factor)
    topk_indices.copy_(chosen)
