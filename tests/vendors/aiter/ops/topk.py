"""Fake aiter.ops.topk: biased_grouped_topk_hip and grouped_topk (compiled ops, in-place outputs) with
the shipped stubs' signatures, the launcher's checks (topk_softmax_kernels_group.cu) and the routing
computed here in fp64."""
import torch

from ..jit.core import compile_ops

CALLS = []
GROUPS = (1, 2, 4, 8)  # LAUNCHER2's cases; anything else: "Unsupported num_expert_group"


def _check(gating_output, topk_weights, topk_ids, num_expert_group, topk_group):
    if gating_output.dim() != 2 or gating_output.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"gating_output: {gating_output.dim()}-D {gating_output.dtype}")
    if gating_output.stride(1) != 1:
        raise RuntimeError("gating_output last dimension must be contiguous")
    tokens, experts = gating_output.shape
    topk = topk_ids.shape[1]
    vector = 4 if experts % 4 == 0 else 2 if experts % 4 == 2 else 1
    aligned = vector * gating_output.element_size()
    if gating_output.data_ptr() % aligned or (gating_output.stride(0) * gating_output.element_size()) % aligned:
        raise RuntimeError(f"fake: rows are read as {vector}-element vectors; misaligned gating_output")
    if num_expert_group not in GROUPS:
        raise RuntimeError(f"Unsupported num_expert_group: {num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        raise RuntimeError("topk_grp must be in [1, num_expert_group]")
    if (experts // num_expert_group) % vector:
        raise RuntimeError("fake: a vector load straddles two expert groups; the kernel masks whole vectors")
    if topk > 64:
        raise RuntimeError("fake: one wavefront (64 lanes) holds the picks")
    if topk_weights.dtype != torch.float32 or topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_weights {topk_weights.dtype}, topk_ids {topk_ids.dtype}")
    if topk_weights.shape != (tokens, topk) or topk_ids.shape != (tokens, topk):
        raise ValueError(f"outputs {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)} for {tokens} tokens")
    if topk_weights.stride(0) != topk_ids.stride(0) or topk_weights.stride(1) != 1 or topk_ids.stride(1) != 1:
        raise RuntimeError("fake: both outputs are written at topk_ids.stride(0) (stride_tk)")


def _route(choice, weight_source, groups, kept_groups, need_renorm, scale, topk, top2):
    """ids and weights per token, fp64: groups ranked by their best (top2: two best) choice scores."""
    tokens, experts = choice.shape
    size = experts // groups
    ranked = choice.view(tokens, groups, size).sort(dim=-1, descending=True).values
    group_score = ranked[..., :2].sum(-1) if top2 else ranked[..., 0]
    best_groups = group_score.argsort(dim=-1, descending=True)[:, :kept_groups]
    allowed = torch.zeros(tokens, groups, dtype=torch.bool).scatter(1, best_groups, True)
    allowed = allowed[:, :, None].expand(tokens, groups, size).reshape(tokens, experts)
    ids = choice.masked_fill(~allowed, -torch.inf).argsort(dim=-1, descending=True)[:, :topk]
    weights = weight_source.gather(1, ids)
    if need_renorm:
        weights = weights / weights.sum(dim=1, keepdim=True)
    return ids, weights * scale


@compile_ops("module_moe_asm", fc_name="biased_grouped_topk", develop=True)
def biased_grouped_topk_hip(
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_grp: int,
    need_renorm: bool,
    routed_scaling_factor: float = 1.0,
) -> None:
    CALLS.append(dict(op="biased_grouped_topk_hip", groups=num_expert_group, dtype=gating_output.dtype))
    _check(gating_output, topk_weights, topk_ids, num_expert_group, topk_grp)
    if correction_bias.dtype != gating_output.dtype:
        raise TypeError(f"fake: the kernel reads correction_bias as {gating_output.dtype} "
                        f"(reinterpret_cast<scalar_t*>), got {correction_bias.dtype}")
    if correction_bias.shape != (gating_output.shape[1],) or not correction_bias.is_contiguous():
        raise ValueError(f"correction_bias {tuple(correction_bias.shape)}")
    if num_expert_group in (2, 4):
        raise AssertionError("fake: for 2 or 4 groups the kernel's group top-2 is not reduced across its "
                             "32 or 16 lanes (lane_steps 0); its result would be wrong")
    weights_source = torch.sigmoid(gating_output.double())
    choice = weights_source + correction_bias.double()
    ids, weights = _route(choice, weights_source, num_expert_group, topk_grp, need_renorm, routed_scaling_factor,
                          topk_ids.shape[1], top2=True)
    topk_ids.copy_(ids)
    topk_weights.copy_(weights)


@compile_ops("module_moe_asm", develop=True)
def grouped_topk(
    gating_output: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    need_renorm: bool,
    is_softmax: bool = True,
    routed_scaling_factor: float = 1.0,
) -> None:
    CALLS.append(dict(op="grouped_topk", groups=num_expert_group, softmax=is_softmax, dtype=gating_output.dtype))
    _check(gating_output, topk_weights, topk_ids, num_expert_group, topk_group)
    logits = gating_output.double()
    scores = logits.softmax(dim=-1) if is_softmax else logits.sigmoid()
    ids, weights = _route(scores, scores, num_expert_group, topk_group, need_renorm, routed_scaling_factor,
                          topk_ids.shape[1], top2=False)
    topk_ids.copy_(ids)
    topk_weights.copy_(weights)
