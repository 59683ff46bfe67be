"""Fake flashinfer.fused_moe (0.6.14): fused_topk_deepseek, cutlass_fused_moe and the trtllm-gen routed entry
points (trtllm_bf16_routed_moe, trtllm_fp8_block_scale_routed_moe) with the shipped signatures, argument checks
and weight layouts, computing what the vendor's dataflow computes, written here independently."""
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
CAPABILITY = (9, 0)  # the device the fake stands for: cutlass's block scales need sm_90, trtllm-gen a major of 10 or 12


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
    if use_deepseek_fp8_block_scale and CAPABILITY != (9, 0):
        raise NotImplementedError("FP8 block scaling not yet implemented for Blackwell.")
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


# The trtllm-gen routed entry points (fused_moe/core.py; csrc/trtllm_fused_moe_kernel_launcher.cu,
# trtllm_fused_moe_runner.cu, fused_moe/trtllm_backend/*.cu), their enums re-exported from flashinfer.tllm_enums.
class RoutingMethodType(enum.IntEnum):
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    SigmoidRenorm = 6
    MiniMax2 = 7
    Sigmoid = 8
    Unspecified = 9


class WeightLayout(enum.IntEnum):
    MajorK = 0
    MajorMn = 1
    BlockMajorK = 2


class Fp8QuantizationType(enum.IntEnum):
    NoneFp8 = 0
    DeepSeekFp8 = 1
    MxFp8 = 2


# utils.py srcToDstBlk32RowMap (epilogue_tile_m 128): row r of each block of 32 goes to row ROW_MAP_32[r].
ROW_MAP_32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
              4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]
TRTLLM_CALLS = []


def _need(condition, message):
    if not condition:
        raise ValueError(message)


def _check_device():
    # FusedMoeLauncher::init_common
    _need(CAPABILITY[0] in (10, 12), f"MoE kernel requires SM 10.x or SM 12.x architecture. Current device has "
                                     f"SM {CAPABILITY[0]}{CAPABILITY[1]}")


def _routes(topk_ids, tokens, num_experts, top_k, local_expert_offset, local_num_experts):
    """check_routing_common and the packed input (PackedScoreIdx {bf16 score; int16 idx}): per (token, slot) the
    local expert (-1 where it is not local) and the weight, as the routing and finalize kernels read them."""
    _need(0 < top_k <= num_experts, "top_k must be between 1 and num_experts")
    _need(0 < local_num_experts <= num_experts, "local_num_experts must be between 1 and num_experts")
    _need(local_expert_offset >= 0 and local_expert_offset + local_num_experts <= num_experts,
          "expert offset and count must be within valid range")
    _need(topk_ids.dtype == torch.int32 and topk_ids.dim() == 2, "expert_indices must be a 2D int32 tensor.")
    _need(tuple(topk_ids.shape) == (tokens, top_k),
          f"expert_indices {tuple(topk_ids.shape)}, expected ({tokens}, {top_k})")
    _need(topk_ids.is_contiguous(), "topk_ids is read as raw packed int32: it must be contiguous")
    ids = topk_ids.long() >> 16
    low = topk_ids.long() & 0xFFFF
    weight = torch.where(low >= 0x8000, low - 0x10000, low).to(torch.int16).view(torch.bfloat16).double()
    # The non-block routing kernels index their histograms by id, and duplicates race for one slot.
    _need(bool(((ids >= 0) & (ids < num_experts)).all()), f"expert ids outside [0, {num_experts})")
    ordered = ids.sort(dim=1).values
    _need(bool((ordered[:, 1:] != ordered[:, :-1]).all()), "duplicate expert ids in a row")
    local = ids - local_expert_offset
    local = torch.where((local >= 0) & (local < local_num_experts), local, -1)
    return local, weight


def _finish(local, weight, tokens, hidden_size, down, output):
    """finalizeKernel: sum over local slots of float(bf16 weight) * bf16 GEMM2 output, in fp32, bf16 out."""
    total = torch.zeros((tokens, hidden_size), dtype=torch.float64)
    for (t, j), y in down.items():
        total[t] += float(weight[t, j]) * y
    if output is None:
        output = torch.empty((tokens, hidden_size), dtype=torch.bfloat16)
    _need(tuple(output.shape) == (tokens, hidden_size) and output.dtype == torch.bfloat16 and output.is_contiguous(),
          "output must be a contiguous bf16 [num_tokens, hidden_size]")
    output.copy_(total.float().to(torch.bfloat16))
    return output


def _per_expert(local):
    """{local expert: (tokens, slots)} of the routed pairs."""
    return {e: (local == e).nonzero(as_tuple=True) for e in local.unique().tolist() if e >= 0}


def _unsupported(**options):
    for name, value in options.items():
        if value is not None:
            raise NotImplementedError(f"fake: {name} is not modelled")


def trtllm_bf16_routed_moe(
    topk_ids,
    hidden_states,
    gemm1_weights,
    gemm2_weights,
    num_experts,
    top_k,
    n_group,
    topk_group,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    routed_scaling_factor=None,
    routing_method_type=0,
    use_shuffled_weight=True,
    weight_layout=WeightLayout.BlockMajorK,
    do_finalize=True,
    enable_pdl=True,
    gemm1_lora_delta=None,
    tune_max_num_tokens=8192,
    activation_type=ActivationType.Swiglu.value,
    routing_replay_out=None,
    gemm1_alpha=None,
    gemm1_beta=None,
    gemm1_clamp_limit=None,
    output=None,
):
    TRTLLM_CALLS.append(dict(entry="trtllm_bf16_routed_moe", num_experts=num_experts, top_k=top_k,
                             offset=local_expert_offset, local=local_num_experts, method=routing_method_type,
                             topk_ids=topk_ids.clone()))
    _check_device()
    _unsupported(gemm1_lora_delta=gemm1_lora_delta, routing_replay_out=routing_replay_out, gemm1_alpha=gemm1_alpha,
                 gemm1_beta=gemm1_beta, gemm1_clamp_limit=gemm1_clamp_limit)
    _need(routing_method_type in set(RoutingMethodType), f"routing_method_type {routing_method_type}")
    if not do_finalize:
        raise NotImplementedError("fake: do_finalize=False is not modelled")
    if activation_type != ActivationType.Swiglu:
        raise NotImplementedError(f"fake: activation {activation_type} is not modelled")
    _need(weight_layout == WeightLayout.BlockMajorK, "BF16 Moe: weight_layout must be BlockMajorK")
    if not use_shuffled_weight:
        raise NotImplementedError("fake: unshuffled BlockMajorK weights are not modelled")
    for name, tensor in (("hidden_states", hidden_states), ("gemm1_weights", gemm1_weights),
                         ("gemm2_weights", gemm2_weights)):
        _need(tensor.dtype == torch.bfloat16, f"BF16 MoE: {name} must be bfloat16.")
        _need(tensor.is_contiguous(), f"{name} is read through its data pointer: it must be contiguous")
    _need(hidden_states.dim() == 2, "hidden_states must be 2D.")
    tokens, hidden_size = hidden_states.shape
    inter = intermediate_size
    _need(inter % 128 == 0, "the second dimension of weights must be a multiple of 128.")
    # BlockMajorK [E, K / blockK, Mn, blockK] with blockK 128 bytes.
    _need(gemm1_weights.dim() == 4 and gemm1_weights.shape[3] == 64, "gemm1_weights: [E, K / 64, Mn, 64]")
    _need(gemm1_weights.shape[2] == 2 * inter, "intermediate_size has incorrect shape.")
    _need(gemm1_weights.shape[1] * 64 == hidden_size, "gemm1 weights K dimension must be equal to hidden_size.")
    _need(tuple(gemm2_weights.shape) == (local_num_experts, inter // 64, hidden_size, 64),
          f"gemm2_weights {tuple(gemm2_weights.shape)}: [E, I / 64, H, 64]")
    _need(gemm1_weights.shape[0] == local_num_experts, "one gemm1 matrix per local expert")
    local, weight = _routes(topk_ids, tokens, num_experts, top_k, local_expert_offset, local_num_experts)
    w1 = _unshuffled(_unblocked(gemm1_weights)).double()
    w2 = _unshuffled(_unblocked(gemm2_weights)).double()
    linear, gate = w1[:, 0::2], w1[:, 1::2]  # reorder_rows_for_gated_act_gemm: [x1 (linear); x2 (gate)] interleaved
    x = hidden_states.double()
    down = {}
    for e, (t, j) in _per_expert(local).items():
        up_rows = x[t] @ linear[e].T
        gate_rows = x[t] @ gate[e].T
        act = (torch.nn.functional.silu(gate_rows.float()).double() * up_rows.float().double())
        act = act.to(torch.bfloat16).double()  # the fused epilogue's bf16 output
        y = (act @ w2[e].T).to(torch.bfloat16).double()  # gemm2_output, bf16
        for row, (tt, jj) in enumerate(zip(t.tolist(), j.tolist())):
            down[(tt, jj)] = y[row]
    return _finish(local, weight, tokens, hidden_size, down, output)


def _unblocked(weights):
    """[E, K / b, Mn, b] -> [E, Mn, K] (convert_to_block_layout undone)."""
    experts, blocks, rows, width = weights.shape
    return weights.permute(0, 2, 1, 3).reshape(experts, rows, blocks * width)


def _unshuffled(weights):
    """Rows back from the shuffled order: original row b * 32 + r sits at b * 32 + ROW_MAP_32[r]."""
    rows = weights.shape[1]
    _need(rows % 32 == 0, "input_tensor.shape[0] must be multiples of 32")
    source = torch.tensor([b + ROW_MAP_32[r] for b in range(0, rows, 32) for r in range(32)])
    return weights[:, source]


def _e4m3_groups(values):
    """activationDeepSeekKernel's quantization, per row and 128 columns: s = max(amax / 448, FLT_MIN), codes
    e4m3(v / s), read back as codes * s. GEMM1's DeepSeek epilogue (in the cubins) is taken to round the same way."""
    rows, cols = values.shape
    out = torch.empty_like(values)
    for start in range(0, cols, 128):
        group = values[:, start:start + 128].float()
        scale = (group.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (group / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out[:, start:start + 128] = codes.double() * scale.double()
    return out


def trtllm_fp8_block_scale_routed_moe(
    topk_ids,
    routing_bias,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    num_experts,
    top_k,
    n_group,
    topk_group,
    intermediate_size,
    local_expert_offset,
    local_num_experts,
    routed_scaling_factor,
    routing_method_type=0,
    use_shuffled_weight=False,
    weight_layout=0,
    do_finalize=True,
    enable_pdl=None,
    gemm1_lora_delta=None,
    output=None,
    tune_max_num_tokens=8192,
    fp8_quantization_type=Fp8QuantizationType.DeepSeekFp8,
    activation_type=ActivationType.Swiglu.value,
    gemm1_alpha=None,
    gemm1_beta=None,
    gemm1_clamp_limit=None,
):
    TRTLLM_CALLS.append(dict(entry="trtllm_fp8_block_scale_routed_moe", num_experts=num_experts, top_k=top_k,
                             offset=local_expert_offset, local=local_num_experts, method=routing_method_type,
                             topk_ids=topk_ids.clone()))
    _check_device()
    _unsupported(routing_bias=routing_bias, gemm1_lora_delta=gemm1_lora_delta, gemm1_alpha=gemm1_alpha,
                 gemm1_beta=gemm1_beta, gemm1_clamp_limit=gemm1_clamp_limit)
    if not do_finalize:
        raise NotImplementedError("fake: do_finalize=False is not modelled")
    if fp8_quantization_type != Fp8QuantizationType.DeepSeekFp8:
        raise NotImplementedError("fake: MxFp8 is not modelled")
    # Fp8BlockScaleLauncher::check_routing (packed ids) and getValidConfigs.
    _need(routing_method_type in set(RoutingMethodType), f"routing_method_type {routing_method_type}")
    if routing_method_type != RoutingMethodType.DeepSeekV3:
        _need((n_group or 0) <= 1, "Current routing kernel (no groups) only supports n_group <= 1")
        _need((topk_group or 0) <= 1, "Current routing kernel (no groups) only supports topk_group <= 1")
    _need(num_experts % 4 == 0, "Routing kernel expects that num_experts must be divisible by 4")
    _need(num_experts > top_k, "num_experts must be greater than top_k")
    _need(activation_type == ActivationType.Swiglu, "DeepSeekFp8 only supports ActivationType::Swiglu")
    _need(weight_layout in (WeightLayout.MajorK, WeightLayout.BlockMajorK), "weight_layout")
    if use_shuffled_weight or weight_layout != WeightLayout.MajorK:
        raise NotImplementedError("fake: only unshuffled MajorK weights are modelled")
    _need(hidden_states.dtype == torch.float8_e4m3fn, "hidden_states must be fp8.")
    _need(hidden_states.dim() == 2, "hidden_states must be 2D.")
    tokens, hidden_size = hidden_states.shape
    inter = intermediate_size
    _need(inter % 128 == 0, "intermediate_size must be a multiple of 128.")
    checks = (("hidden_states_scale", hidden_states_scale, torch.float32, (hidden_size // 128, tokens)),
              ("gemm1_weights", gemm1_weights, torch.float8_e4m3fn, (local_num_experts, 2 * inter, hidden_size)),
              ("gemm1_weights_scale", gemm1_weights_scale, torch.float32,
               (local_num_experts, 2 * inter // 128, hidden_size // 128)),
              ("gemm2_weights", gemm2_weights, torch.float8_e4m3fn, (local_num_experts, hidden_size, inter)),
              ("gemm2_weights_scale", gemm2_weights_scale, torch.float32,
               (local_num_experts, hidden_size // 128, inter // 128)))
    for name, tensor, dtype, shape in checks:
        _need(tensor.dtype == dtype and tuple(tensor.shape) == shape,
              f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")
        _need(tensor.is_contiguous(), f"{name} is read through its data pointer: it must be contiguous")
    _need(hidden_states.is_contiguous(), "hidden_states must be contiguous")
    local, weight = _routes(topk_ids, tokens, num_experts, top_k, local_expert_offset, local_num_experts)
    x = hidden_states.double() * hidden_states_scale.double().t().repeat_interleave(128, dim=1)
    w1 = gemm1_weights.double() * gemm1_weights_scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    w2 = gemm2_weights.double() * gemm2_weights_scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    down = {}
    for e, (t, j) in _per_expert(local).items():
        gemm1 = _e4m3_groups(x[t] @ w1[e].T)  # gemm1_output: e4m3 with 1x128 scales
        linear, gate = gemm1[:, :inter], gemm1[:, inter:]
        act = torch.nn.functional.silu(gate.float()).double() * linear
        y = (_e4m3_groups(act) @ w2[e].T).to(torch.bfloat16).double()  # activation_output e4m3; gemm2_output bf16
        for row, (tt, jj) in enumerate(zip(t.tolist(), j.tolist())):
            down[(tt, jj)] = y[row]
    return _finish(local, weight, tokens, hidden_size, down, output)
