"""Fake aiter.fused_moe: fused_moe's shipped signature and host rules (aiter's enums, shuffled weights,
per_128x128 as dynamic 1x128 activations in its kernel's arithmetic, a mask numbering local experts
cumsum(mask) - 1), the experts in fp64 with the 16-bit stores of a two-stage kernel."""
import torch

from aiter import ActivationType, QuantType, dtypes
from aiter.ops.shuffle import unshuffle_weight

CALLS = []


def _quantize_1x128(x):
    """Rows of x (fp64 of 16-bit values) quantized per 128 columns to aiter's fp8 and back, in fp32 as
    dynamic_per_group_scaled_quant does (reciprocal correctly rounded here)."""
    rows, cols = x.shape
    groups = x.float().view(rows, cols // 128, 128)
    fp8_max = torch.tensor(torch.finfo(dtypes.fp8).max, dtype=torch.float32)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) * (1.0 / fp8_max)
    codes = (groups * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(dtypes.fp8)
    return (codes.double() * scale.double()).view(rows, cols)


def fused_moe(
    hidden_states,
    w1,  # [expert(local_expert:EP), inter_dim*2, dim] N,K
    w2,  # [expert(local_expert:EP), dim, inter_dim]
    topk_weight,
    topk_ids,
    expert_mask=None,  # EP
    activation=ActivationType.Silu,
    quant_type=QuantType.No,
    doweight_stage1=False,
    w1_scale=None,  # [expert(local_expert:EP), inter_dim, 1]
    w2_scale=None,  # [expert(local_expert:EP), model_dim, 1]
    a1_scale=None,  # [expert(local_expert:EP), 1, model_dim]
    a2_scale=None,  # [expert(local_expert:EP), 1, inter_dim]
    block_size_M=None,
    num_local_tokens=None,
    moe_sorting_dispatch_policy=0,
    dtype=None,
    hidden_pad=0,
    intermediate_pad=0,
    bias1=None,
    bias2=None,
    splitk=0,
    swiglu_limit=None,
    beta=None,
    linear_beta=None,
    gate_mode="separated",
    shared_w1=None,
    shared_w2=None,
    shared_w1_scale=None,
    shared_w2_scale=None,
    shared_expert_id=-1,
    stage2_scatter=None,
):
    CALLS.append(dict(activation=activation, quant_type=quant_type, mask=expert_mask is not None,
                      doweight_stage1=doweight_stage1))
    if not isinstance(activation, ActivationType) or not isinstance(quant_type, QuantType):
        raise TypeError("fused_moe calls activation.value and quant_type.value: aiter's enums expected")
    if activation not in (ActivationType.Silu, ActivationType.Gelu) or quant_type not in (QuantType.No,
                                                                                          QuantType.per_128x128):
        raise NotImplementedError(f"fake: {activation!r} x {quant_type!r} not modelled")
    if doweight_stage1 or a1_scale is not None or a2_scale is not None or bias1 is not None or bias2 is not None:
        raise NotImplementedError("fake: router weights on the output, dynamic activation scales, no biases")
    if shared_w1 is not None or stage2_scatter is not None or hidden_pad or intermediate_pad:
        raise NotImplementedError("fake: no shared expert, scatter or padding")
    out_dtype = hidden_states.dtype if dtype is None else dtype
    if out_dtype not in (dtypes.fp16, dtypes.bf16):
        raise AssertionError(f"Fused_moe unsupported out dtype: {out_dtype}")
    if hidden_states.dtype not in (dtypes.fp16, dtypes.bf16) or not hidden_states.is_contiguous():
        raise TypeError(f"fake: contiguous 16-bit hidden_states, got {hidden_states.dtype}")
    if not (getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False)):
        raise AssertionError("fake: the tuned kernels read preshuffled weights (shuffle_weight, is_shuffled)")
    experts, two_inter, hidden_size = w1.shape
    inter = two_inter // 2
    if w2.shape != (experts, hidden_size, inter) or hidden_states.shape[1] != hidden_size:
        raise AssertionError(f"Invalid MoE weight: {w1.shape=} {w2.shape=}")
    tokens, topk = topk_ids.shape
    if topk_ids.dtype != torch.int32 or topk_weight.dtype != torch.float32 or topk_weight.shape != topk_ids.shape:
        raise TypeError(f"fake: topk_ids int32 and topk_weight fp32 of one shape, got {topk_ids.dtype}, "
                        f"{topk_weight.dtype}")
    if not topk_ids.is_contiguous() or not topk_weight.is_contiguous():
        raise RuntimeError("fake: moe_sorting reads the routing as packed rows")
    local = torch.arange(experts)
    if expert_mask is not None:
        if expert_mask.dtype != torch.int32 or expert_mask.dim() != 1 or int(expert_mask.sum()) != experts:
            raise ValueError("fake: an int32 0/1 mask with one 1 per local expert")
        local = torch.where(expert_mask == 1, expert_mask.cumsum(0) - 1, -1)
    ids = topk_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= local.shape[0]):
        raise IndexError("fake: topk_ids outside the (mask's) expert range")
    w1f, w2f = unshuffle_weight(w1).double(), unshuffle_weight(w2).double()
    block = quant_type == QuantType.per_128x128
    if block:
        if w1.dtype != dtypes.fp8 or w2.dtype != dtypes.fp8 or hidden_states.dtype != dtypes.bf16:
            raise TypeError(f"fake: bf16 activations and aiter's fp8 ({dtypes.fp8}) weights, got {w1.dtype}")
        if hidden_size % 128 or inter % 128:
            raise AssertionError("block size 128 not match")  # per_group_quant_hip views x as (-1, 128)
        for scale, rows, cols in ((w1_scale, two_inter, hidden_size), (w2_scale, hidden_size, inter)):
            if scale is None or scale.dtype != torch.float32 or not scale.is_contiguous() \
                    or scale.shape != (experts, rows // 128, cols // 128):
                raise ValueError("fake: fp32 block scales [E, rows/128, cols/128]")
        w1f = w1f * w1_scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
        w2f = w2f * w2_scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    elif w1.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise TypeError(f"fake: QuantType.No takes weights in the hidden dtype, got {w1.dtype}")
    x = hidden_states.double()
    if block:
        x = _quantize_1x128(x)
    act = torch.nn.functional.silu if activation == ActivationType.Silu else torch.nn.functional.gelu
    stored = hidden_states.dtype
    out = torch.zeros(tokens, hidden_size, dtype=torch.float64)
    expert_of = local[ids]  # [T, k], -1: masked
    for e in range(experts):
        token, slot = (expert_of == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = (x[token] @ w1f[e].T).to(stored).double()
        inner = (act(gate_up[:, :inter].float()).double() * gate_up[:, inter:]).to(stored).double()
        if block:
            inner = _quantize_1x128(inner)
        out.index_add_(0, token, (inner @ w2f[e].T) * topk_weight[token, slot].double()[:, None])
    return out.to(out_dtype)
