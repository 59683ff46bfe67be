"""The torch backend's fused_moe: unquantized bf16 experts on ``torch._grouped_mm`` (CUTLASS
grouped GEMMs on sm_90/sm_100), with the routing sorted, gathered and reduced on the device so no
call reads a tensor's values on the host and the whole op can be captured in a CUDA graph."""

# What torch's grouped_mm takes, read from aten/src/ATen/native/cuda/GroupedBlas.cpp
# (_grouped_mm_cuda) and native/GroupedMMUtils.h (2.10-2.12):
# - the fast path, which reads offs on the device, needs bf16 inputs and output on major 9 or 10;
#   fp16 (or another arch) goes to _grouped_mm_fallback, which copies offs to the host and loops.
# - offs: int32, 1-D, one cumulative end per group of mat_b; rows past offs[-1] are not written.
# - operands: 16-byte aligned data, and the stride that is not 1 a multiple of 16 bytes
#   (check_valid_strides_and_return_transposed): H and I multiples of 8 for bf16.
# - out_dtype must equal the inputs' (_resolve_grouped_mm_out_dtype): each GEMM rounds its fp32
#   accumulation to bf16 once, where the spec's dataflow stores GEMM1's result, and the per-expert
#   rounding of GEMM2's result the spec's tolerance allows.

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec

__all__ = ["fused_moe", "supports"]

ROW_ALIGN = 8  # elements: 16-byte bf16 rows for grouped_mm's TMA


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when torch's grouped_mm computes calls with this key as the spec defines them, else
    why not. The arch (sm_90/sm_100) and the installed torch are the static check."""
    if key.quantization != "none":
        return (f"unquantized weights only, got quantization {key.quantization!r} (torch's grouped_mm "
                "takes no weight scales)")
    if key.hidden_dtype != torch.bfloat16:
        return (f"bf16 only, got {key.hidden_dtype}: torch's CUDA grouped_mm runs other dtypes as a "
                "per-expert loop that reads the offsets on the host (a device sync, not capturable)")
    if key.hidden_size % ROW_ALIGN or key.intermediate_size % ROW_ALIGN:
        return (f"H and I multiples of {ROW_ALIGN} only (16-byte rows for grouped_mm), got H "
                f"{key.hidden_size}, I {key.intermediate_size}")
    for name in ("w1", "w2"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.dense_rows:
            return (f"{name} needs a unit stride along its rows and 16-byte aligned data and strides "
                    f"(grouped_mm reads it in place; weights are not copied per call), got {tensor_layout}")
    return None


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    quantization: str = "none",
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return hidden.new_zeros((0, hidden_size))
    experts, inter_size = w1.shape[0], w1.shape[1] // 2
    topk = topk_ids.shape[1]
    dtype = hidden.dtype

    # One row per (token, slot) pair, sorted by local expert; pairs routed off this rank get the
    # key E, so they sort last, past offs[-1], where grouped_mm computes nothing.
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    keys = ids.masked_fill(ids < 0, experts)
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    group_ids = torch.arange(experts, device=keys.device, dtype=keys.dtype)
    offs = torch.searchsorted(sorted_keys, group_ids, right=True, out_int32=True)
    local = (sorted_keys < experts).unsqueeze(1)

    x = hidden[order // topk]
    weights = topk_weights.reshape(-1).float()[order].unsqueeze(1)
    if apply_router_weight_on_input:
        x = (x.float() * weights).to(dtype)  # k == 1: the product in fp32, rounded for the GEMM

    gate_up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    gate, up = gate_up[:, :inter_size].float(), gate_up[:, inter_size:].float()
    gated = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate)
    inter = (gated * up).to(dtype)
    down = torch._grouped_mm(inter, w2.transpose(-2, -1), offs=offs).float()
    if not apply_router_weight_on_input:
        down = down * weights
    # Rows past offs[-1] hold whatever memory grouped_mm left there (NaN included): select, not multiply.
    down = torch.where(local, down, 0.0)
    slots = torch.empty_like(down).index_copy_(0, order, down)
    return slots.view(num_tokens, topk, hidden_size).sum(dim=1).to(dtype)
