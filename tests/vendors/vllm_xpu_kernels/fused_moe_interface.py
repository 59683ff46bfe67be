"""Fake vllm-xpu-kernels 0.1.16.2: fused_moe_interface.XpuFusedMoe with the shipped constructor and apply()
signatures and layout rules (16-bit experts as contiguous [E, K, N]), running apply()'s 16-bit dataflow on
the fake torch ops as the vendor's code calls them; quantized recipes raise NotImplementedError."""

from typing import Optional

import torch

try:
    from . import _C  # noqa: F401
    from . import _moe_C  # noqa: F401
    from . import _xpu_C  # noqa: F401
    FUSEDMOE_UNAVAILABLE_REASON = None
    FUSEDMOE_AVAILABLE = True
except ImportError as error:
    FUSEDMOE_UNAVAILABLE_REASON = str(error)
    FUSEDMOE_AVAILABLE = False

ACTIVATIONS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul"}  # the ones modelled


class XpuFusedMoe:
    def __init__(
        self,
        w13,
        w13_scales,
        w13_bias,
        w2,
        w2_scales,
        w2_bias,
        n_experts_per_token,
        activation,
        num_experts,
        ep_rank=0,
        ep_size=1,
        expert_map=None,
        gemm1_clamp_limit: Optional[float] = None,
        activation_situ_beta: Optional[float] = None,
        activation_situ_linear_beta: Optional[float] = None,
    ):
        assert w13.is_contiguous() and w2.is_contiguous()
        if w13.dtype not in (torch.bfloat16, torch.float16) or w13_scales is not None or w2_scales is not None:
            raise NotImplementedError("fake vllm_xpu_kernels: only 16-bit experts are modelled")
        if w13_bias is not None or w2_bias is not None or gemm1_clamp_limit is not None or ep_size != 1:
            raise NotImplementedError("fake vllm_xpu_kernels: biases, clamping and implicit EP maps are not modelled")
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unsupported FusedMoe activation: {activation}.")
        self.inter_size = w13.shape[-1] // 2  # 16-bit experts are [E, K, N]
        self.w13, self.w2 = w13, w2
        self.n_experts_per_token = n_experts_per_token
        self.act_func = getattr(torch.ops._C, ACTIVATIONS[activation])
        self.num_experts = num_experts
        self.expert_map = expert_map
        self.total_experts_num = expert_map.shape[0] if expert_map is not None else num_experts * ep_size
        self.local_experts_num = num_experts

    def apply(
        self,
        output,
        hidden_states,
        topk_weights,
        topk_ids,
        expert_map=None,
        a1q_scale=None,
    ):
        if a1q_scale is not None:
            raise NotImplementedError("fake vllm_xpu_kernels: quantized activations are not modelled")
        num_rows, hidden_size = hidden_states.shape
        pairs = self.n_experts_per_token * num_rows
        # Rows routed nowhere (all ids negative, DP padding) are zeroed before the remap.
        hidden_states = hidden_states.masked_fill((topk_ids < 0).all(dim=1).unsqueeze(1), 0)
        remapped = torch.empty((pairs, hidden_size), dtype=hidden_states.dtype)
        rows_per_expert = torch.zeros(self.num_experts, dtype=torch.int32)
        unpermuted = torch.empty((num_rows, self.n_experts_per_token), dtype=torch.int32)
        torch.ops._moe_C.remap_hidden_states(
            hidden_states=hidden_states, hidden_states_scales=None, remapped_hidden_states=remapped,
            remapped_hidden_states_scales=None, expert_map=expert_map, rows_per_expert=rows_per_expert,
            unpermuted_row_to_permuted_row=unpermuted, topk_ids=topk_ids, total_experts_num=self.total_experts_num,
            local_experts_num=self.local_experts_num)
        gemm1 = torch.empty((pairs, 2 * self.inter_size), dtype=output.dtype)
        torch.ops._xpu_C.cutlass_grouped_gemm_interface(
            ptr_A=remapped, ptr_A_scale=None, ptr_B=self.w13, ptr_B_scale=None, ptr_bias=None, ptr_D=gemm1,
            rows_per_expert=rows_per_expert, N=2 * self.inter_size, K=hidden_size, num_experts=self.num_experts)
        act = torch.empty((pairs, self.inter_size), dtype=gemm1.dtype)
        self.act_func(act, gemm1)
        gemm2 = torch.empty((pairs, hidden_size), dtype=output.dtype)
        torch.ops._xpu_C.cutlass_grouped_gemm_interface(
            ptr_A=act, ptr_A_scale=None, ptr_B=self.w2, ptr_B_scale=None, ptr_bias=None, ptr_D=gemm2,
            rows_per_expert=rows_per_expert, N=hidden_size, K=self.inter_size, num_experts=self.num_experts)
        torch.ops._moe_C.moe_gather(output, gemm2, topk_weights, unpermuted, self.num_experts)
