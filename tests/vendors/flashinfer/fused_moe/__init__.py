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


# cutlass_fused_moe (fused_moe/core.py, TensorRT-LLM's CUTLASS MoE runner), its enum re-exported from
# flashinfer.tllm_enums. GEMM1's rows 0..I-1 are the linear (up) half, I..2I-1 the gate
# (doGatedActivationKernel: gate_value = gemm_result[i + inter_size]).
import enum  # noqa: E402


class ActivationType(enum.IntEnum):
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    InvalidType = 10


MOE_CALLS = []


def _quantize_1x128(x):
    """scale_1x128_kernel on fp64 rows of bf16 values: per 128 columns, s = 448 / amax (fp32; 1 when
    amax is 0), codes fp8(x * s) saturated, dequant scale 1 / s; returns the dequantized fp64 values."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    for start in range(0, cols, 128):
        group = x[:, start:start + 128].float()
        amax = group.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax != 0, torch.tensor(448.0) / amax, torch.ones_like(amax))
        codes = (group * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out[:, start:start + 128] = codes.double() * (1.0 / scale).double()
    return out


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
                      swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
                      ep_rank=0, cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
                      use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False, use_mxfp8_act_scaling=False,
                      min_latency_mode=False, use_packed_weights=False, tune_max_num_tokens=8192, enable_pdl=None,
                      activation_type=ActivationType.Swiglu, swizzled_input_sf=True):
    MOE_CALLS.append(dict(block=use_deepseek_fp8_block_scale, activation=activation_type, ep_size=ep_size))
    if min_latency_mode:
        raise NotImplementedError("min latency mode not yet implemented for Blackwell.")
    if fc1_expert_biases is not None or fc2_expert_biases is not None or input_sf is not None:
        raise NotImplementedError("fake: biases and input_sf are not modelled")
    if activation_type not in (ActivationType.Swiglu, ActivationType.Geglu):
        raise NotImplementedError(f"fake: activation {activation_type!r} is not modelled")
    if not isinstance(activation_type, ActivationType):
        raise TypeError(f"activation_type: {type(activation_type).__name__}")
    # The runner reads raw pointers: every tensor must be dense (the fake insists).
    tensors = dict(input=input, token_selected_experts=token_selected_experts, token_final_scales=token_final_scales,
                   fc1_expert_weights=fc1_expert_weights, fc2_expert_weights=fc2_expert_weights)
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if use_deepseek_fp8_block_scale:
        if input.dtype != torch.bfloat16 or fc1_expert_weights.dtype != torch.float8_e4m3fn:
            raise TypeError(f"Could not construct fused moe op: {input.dtype} x {fc1_expert_weights.dtype}")
    elif input.dtype not in (torch.float16, torch.bfloat16) or fc1_expert_weights.dtype != input.dtype:
        raise TypeError(f"Could not construct fused moe op: {input.dtype} x {fc1_expert_weights.dtype}")
    if fc2_expert_weights.dtype != fc1_expert_weights.dtype:
        raise TypeError("fc2_expert_weights dtype")
    if output_dtype != input.dtype:
        raise TypeError(f"fake: output {output_dtype} for input {input.dtype} is not modelled")
    if token_selected_experts.dtype != torch.int32 or token_final_scales.dtype != torch.float32:
        raise TypeError(f"{token_selected_experts.dtype} ids, {token_final_scales.dtype} scales")
    tokens, hidden_size = input.shape
    experts, hidden2, inter = fc2_expert_weights.shape
    if token_selected_experts.dim() != 2 or token_selected_experts.shape[0] != tokens:
        raise ValueError("input and token_selected_experts must have the same num tokens.")
    if token_final_scales.shape != token_selected_experts.shape:
        raise ValueError("token_final_scales shape")
    if fc1_expert_weights.shape != (experts, 2 * inter, hidden_size) or hidden2 != hidden_size:
        raise ValueError(f"fc1 {tuple(fc1_expert_weights.shape)}, fc2 {tuple(fc2_expert_weights.shape)}")
    alignment = 128 // (8 * min(input.element_size(), fc1_expert_weights.element_size()))
    if hidden_size % alignment or inter % alignment:
        raise ValueError(f"hidden_size {hidden_size} / inter_size {inter} must be divisible by {alignment}")
    if output is None:
        output = torch.empty((tokens, hidden_size), dtype=output_dtype)
    elif output.shape != (tokens, hidden_size) or output.dtype != output_dtype or not output.is_contiguous():
        raise ValueError("output")
    w1 = fc1_expert_weights.double()
    w2 = fc2_expert_weights.double()
    if use_deepseek_fp8_block_scale:
        if len(quant_scales) != 2:
            raise ValueError("fp8 block scaling: quant_scales = [fc1 scales, fc2 scales]")
        s1, s2 = quant_scales
        for s, rows, cols in ((s1, 2 * inter, hidden_size), (s2, hidden_size, inter)):
            if (s.dtype != torch.float32 or not s.is_contiguous()
                    or s.shape != (experts, -(-rows // 128), -(-cols // 128))):
                raise ValueError(f"block scales {s.dtype} {tuple(s.shape)}")
        w1 = w1 * s1.double().repeat_interleave(128, 1)[:, :2 * inter].repeat_interleave(128, 2)[:, :, :hidden_size]
        w2 = w2 * s2.double().repeat_interleave(128, 1)[:, :hidden_size].repeat_interleave(128, 2)[:, :, :inter]
    act = torch.nn.functional.silu if activation_type == ActivationType.Swiglu else torch.nn.functional.gelu
    dtype = input.dtype
    x = input.double()
    if use_deepseek_fp8_block_scale:
        x = _quantize_1x128(x)
    start = ep_rank * experts
    total = torch.zeros((tokens, hidden_size), dtype=torch.float64)
    for t in range(tokens):
        for j in range(token_selected_experts.shape[1]):
            e = int(token_selected_experts[t, j]) - start
            if e < 0 or e >= experts:
                continue  # another rank's expert (or -1)
            gemm1 = (w1[e] @ x[t]).to(dtype).double()  # GEMM1's output in the activation type
            linear, gate = gemm1[:inter], gemm1[inter:]
            inter_act = (act(gate.float()).double() * linear).to(dtype).double()
            if use_deepseek_fp8_block_scale:
                inter_act = _quantize_1x128(inter_act.unsqueeze(0))[0]
            down = (w2[e] @ inter_act).to(dtype).double()  # GEMM2's output, unfused finalize
            total[t] += float(token_final_scales[t, j]) * down
    output.copy_(total.to(output_dtype))
    return [output, torch.empty(1, dtype=torch.int32), torch.empty(0), torch.empty(0, dtype=torch.int32)]
