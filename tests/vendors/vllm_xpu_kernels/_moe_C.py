"""Fake vllm-xpu-kernels 0.1.16.2: the _moe_C extension (csrc/moe), registering grouped_topk, remap_hidden_states
and moe_gather with the shipped schemas, their host checks, and CPU kernels that model the SYCL ones (scores
in their own dtype, stable ties); layouts the kernels would misread (raw row pointers) are AssertionErrors."""

import torch

from vllm_xpu_kernels._library import define

CALLS = []  # (op name, dict of what reached the kernel), one per call

TOPKS = (1, 2, 4, 6, 7, 8, 10, 16)  # remap_hidden_states / moe_gather instances
EXCLUSIVE_SIZE = 1024  # remap_hidden_states: local experts counted in local memory
SCORING_NONE, SCORING_SIGMOID = 0, 1
LOGIT_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK


def _raw(tensor, what):
    assert tensor.is_contiguous(), f"fake vllm_xpu_kernels: {what} is read through its raw pointer (no strides)"


def _ranked(values, count):
    """Indices of the ``count`` largest of each row, largest first, ties to the lower index (the
    kernels' is_stable WarpSelect)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :count]


def grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias, scoring_func):
    _check(scores.dim() == 2, "scores must be a 2D Tensor")
    num_tokens, num_experts = scores.shape
    _check(num_experts % n_group == 0, "num_experts should be divisible by n_group")
    _check(n_group <= 32, "n_group should be smaller than or equal to 32 for now")
    _check(topk <= 32, "topk should be smaller than or equal to 32 for now")
    _check(topk <= topk_group * (num_experts // n_group), "topk must be <= topk_group * (num_experts / n_group)")
    _check(scoring_func in (SCORING_NONE, SCORING_SIGMOID),
           "scoring_func must be SCORING_NONE (0) or SCORING_SIGMOID (1)")
    if scores.dtype not in LOGIT_DTYPES:
        raise ValueError("Invalid dtype, only supports float16, float32, and bfloat16")
    if bias.dtype not in LOGIT_DTYPES:
        raise ValueError("Invalid bias dtype, only supports float16, float32, bfloat16")
    _raw(scores, "scores")
    _raw(bias, "bias")
    assert bias.numel() == num_experts, "fake vllm_xpu_kernels: bias[expert] is read for every expert"
    CALLS.append(("grouped_topk", dict(dtype=scores.dtype, scoring_func=scoring_func, tokens=num_tokens)))
    dtype = scores.dtype
    group_size = num_experts // n_group
    # Scores and biased scores live in the scores' dtype T (apply_scoring casts the fp32 sigmoid back
    # to T; score + T(bias) is a T addition).
    scored = scores
    if scoring_func == SCORING_SIGMOID:
        scored = (0.5 * torch.tanh(0.5 * scores.float()) + 0.5).to(dtype)
    biased = (scored + bias.to(dtype)).float()
    # Group score: the top two biased scores summed in fp32 and stored as T; a group of one expert
    # has no second, so -inf (topk_with_k2_biased).
    groups = biased.view(num_tokens, n_group, group_size)
    top1 = groups.amax(dim=-1)
    if group_size > 1:
        top2 = groups.topk(2, dim=-1).values[..., 1]
    else:
        top2 = torch.full_like(top1, float("-inf"))
    group_scores = (top1 + top2).to(dtype).float()
    kept = _ranked(group_scores, topk_group)
    degenerate = group_scores.gather(1, kept[:, -1:]).squeeze(1) == float("-inf")
    member = torch.zeros(num_tokens, n_group, dtype=torch.bool).scatter_(1, kept, True)
    candidates = biased.masked_fill(~member.repeat_interleave(group_size, dim=1), float("-inf"))
    candidates = candidates.masked_fill(torch.isinf(scores.float()), float("-inf"))
    ids = _ranked(candidates, topk)
    unbiased = scored.float().gather(1, ids)
    scale = torch.full((num_tokens, 1), float(routed_scaling_factor))
    if renormalize:
        scale = scale / (1e-20 + unbiased.sum(dim=-1, keepdim=True))
    weights = unbiased * scale
    # A row whose k-th kept group scores -inf gets ids 0..k-1 and weights 1/k.
    ids = torch.where(degenerate[:, None], torch.arange(topk).expand(num_tokens, topk), ids)
    weights = torch.where(degenerate[:, None], torch.full_like(weights, 1.0 / topk), weights)
    return weights.float(), ids.to(torch.int32)


def remap_hidden_states(hidden_states, hidden_states_scales, remapped_hidden_states, remapped_hidden_states_scales,
                        expert_map, rows_per_expert, unpermuted_row_to_permuted_row, topk_ids, total_experts_num,
                        local_experts_num):
    _check(hidden_states.dtype == remapped_hidden_states.dtype,
           "hidden_states and remapped_hidden_states must have save dtype")
    if hidden_states_scales is not None:
        raise NotImplementedError("fake vllm_xpu_kernels: quantized hidden states are not modelled")
    if expert_map is not None:
        _check(expert_map.dtype == torch.int32, "expert_map must be int32")
    _check(rows_per_expert.dtype == torch.int32, "rows_per_expert must be int32")
    _check(topk_ids.dtype in (torch.int64, torch.int32), "topk_ids must be int64 or int32")
    num_rows, hidden_size = hidden_states.shape
    topk = topk_ids.shape[1]
    _check(remapped_hidden_states.shape[0] == num_rows * topk and remapped_hidden_states.shape[1] == hidden_size,
           "remapped_hidden_states must be [num_rows * TopK, hidden_size]")
    if expert_map is not None:
        _check(expert_map.shape[0] == total_experts_num, "expert_map must be [total_experts_num]")
    _check(rows_per_expert.shape[0] == local_experts_num, "rows_per_expert must be [local_experts_num]")
    _check(topk_ids.shape[0] == num_rows and topk_ids.shape[1] == topk, "topk_ids must be [num_rows, TopK]")
    _check(topk in TOPKS, "Unsupported TopK value")
    _check(local_experts_num <= EXCLUSIVE_SIZE, "local_experts_num exceeds the maximum supported number")
    _check(hidden_size % (16 // hidden_states.element_size()) == 0, "hidden_size must be divisible by ElemsPerItem")
    for tensor, what in ((hidden_states, "hidden_states"), (topk_ids, "topk_ids"),
                         (unpermuted_row_to_permuted_row, "unpermuted_row_to_permuted_row"),
                         (remapped_hidden_states, "remapped_hidden_states")):
        _raw(tensor, what)
    ids = topk_ids.long()
    assert bool(((ids >= 0) & (ids < total_experts_num)).all()), "fake vllm_xpu_kernels: expert_map[id] out of range"
    local = expert_map.long()[ids] if expert_map is not None else ids
    counts = torch.bincount(local[local >= 0], minlength=local_experts_num).to(torch.int32)
    rows_per_expert.add_(counts)  # atomically added onto what the caller passed (zeros)
    starts = torch.cumsum(rows_per_expert.long(), 0) - rows_per_expert.long()
    rows = torch.full_like(local, -1)
    flat = local.flatten()
    order = torch.argsort(flat, stable=True)  # within an expert the kernel's atomics pick any order
    valid = order[flat[order] >= 0]
    rank = torch.arange(valid.numel()) - torch.searchsorted(flat[valid], flat[valid], right=False)
    rows.view(-1)[valid] = starts[flat[valid]] + rank
    unpermuted_row_to_permuted_row.copy_(rows.to(torch.int32))
    pairs = rows >= 0
    remapped_hidden_states[rows[pairs]] = hidden_states[pairs.nonzero()[:, 0]]
    CALLS.append(("remap_hidden_states", dict(rows=num_rows, topk=topk, local_experts=local_experts_num)))


def moe_gather(output, moe_output, topk_weights, unpermuted_row_to_permuted_row, num_experts):
    _check(topk_weights.dtype == torch.float32, "topk_weights must be float32")
    topk = topk_weights.shape[1]
    _check(topk in TOPKS, f"error: not support TOPK={topk}")
    if output.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("Unsupported data type in moe_gather")
    for tensor, what in ((output, "output"), (moe_output, "moe_output"), (topk_weights, "topk_weights"),
                         (unpermuted_row_to_permuted_row, "unpermuted_row_to_permuted_row")):
        _raw(tensor, what)
    rows = unpermuted_row_to_permuted_row.long().view(topk_weights.shape)
    terms = moe_output.float()[rows.clamp_min(0)] * topk_weights.unsqueeze(-1)
    terms = terms.masked_fill((rows < 0).unsqueeze(-1), 0.0)  # -1: routed off this rank
    output.copy_(terms.sum(dim=1).to(output.dtype))
    CALLS.append(("moe_gather", dict(tokens=topk_weights.shape[0], topk=topk)))


define("_moe_C", "grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, "
                 "float routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)", grouped_topk)
define("_moe_C", "remap_hidden_states(Tensor hidden_states, Tensor? hidden_states_scales, Tensor "
                 "remapped_hidden_states,Tensor? remapped_hidden_states_scales,Tensor? expert_map, Tensor "
                 "rows_per_expert,Tensor unpermuted_row_to_permuted_row, Tensor topk_ids,int total_experts_num, "
                 "int local_experts_num) -> ()", remap_hidden_states)
define("_moe_C", "moe_gather(Tensor! output, Tensor moe_output, Tensor topk_weights, Tensor "
                 "unpermuted_row_to_permuted_row, int num_experts) -> ()", moe_gather)
