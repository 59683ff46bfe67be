"""The aiter backend's fused_moe on ``aiter.fused_moe.fused_moe`` (routing sort, two CK/asm stages):
bf16/fp16 experts and DeepSeek-V3's 128-block fp8 experts. Its kernels read weights shuffled to the
(16, 16) layout and an expert mask instead of a map; both are prepared per call (``prepare``)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.aiter import AITER, WHERE
from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec

__all__ = ["Prepared", "fused_moe", "metadata", "prepare", "supports"]

# Source: ROCm/aiter e4048607 (0.1.21.dev46), aiter/fused_moe.py (fused_moe, _fused_moe_impl,
# fused_moe_2stages, get_2stage_cfgs, torch_moe), aiter/ops/shuffle.py, op_tests/test_moe_2stage.py.
FP8 = {"e4m3fnuz": torch.float8_e4m3fnuz, "e4m3fn": torch.float8_e4m3fn}  # utility/dtypes.py per gfx
# get_2stage_cfgs warns that its tuned kernels are "optimized for preshuffled weights ... preshuffle_off
# may produce incorrect results": weights go through shuffle_weight(layout=(16, 16)), as vLLM does.
SHUFFLE_LAYOUT = (16, 16)
# aiter's MoE tests run model_dim 7168 x inter_dim 256 (test_moe_2stage.py) and its fp8 block path
# quantizes x.view(-1, 128); shuffle_weight needs rows % 16 and columns % 32. Held to 128 for both.
MULTIPLE = 128


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when fused_moe computes calls with this dispatch key as the spec defines them, else why not."""
    if key.quantization in spec.FP4_MODES:
        return (f"{key.quantization} experts are not wired in this adapter yet (the vendor's fp4 MoE kernels take their own prepared weight and scale layouts, not built here; "
                "the triton and cpu backends serve them)")
    if key.hidden_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 hidden only (fused_moe's out dtypes), got {key.hidden_dtype}"
    if key.quantization == "fp8_per_tensor":
        # For few tokens fused_moe runs a 1-stage asm kernel whose intermediate quantization is inside the
        # code object (asm_stage1 relabels per_Tensor as per_Token); the 2-stage path takes one amax over
        # a torch.empty intermediate whose rows for masked pairs are never written.
        return ("fp8_per_tensor declined: that aiter quantizes the intermediate with one dynamic scale over all "
                "of it, as the spec does, is not shown by its source (1-stage asm kernels; unwritten masked rows)")
    if key.quantization == "fp8_block":
        wanted = FP8.get(platform.fp8_flavour or "")
        if key.weight_dtype != wanted:
            return (f"{platform.fp8_flavour} weights only on {platform.arch} (aiter's dtypes.fp8), "
                    f"got {key.weight_dtype}")
        if key.hidden_dtype != torch.bfloat16:
            return "bf16 hidden only with fp8 block weights (asm_stage1: \"asm only support bf16\")"
    if key.hidden_size % MULTIPLE or key.intermediate_size % MULTIPLE:
        return (f"H and I multiples of {MULTIPLE} only (the shapes aiter's MoE tests cover; shuffle_weight and "
                f"its 1x128 quantization need them), got H = {key.hidden_size}, I = {key.intermediate_size}")
    return None


class Prepared(NamedTuple):
    """fused_moe's operands besides the activations: shuffled weights (``is_shuffled`` set by aiter),
    the routing ids in the mask's numbering, and the mask (None without an expert map)."""

    w1: torch.Tensor
    w2: torch.Tensor
    topk_ids: torch.Tensor
    expert_mask: Optional[torch.Tensor]


def prepare(w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            expert_map: Optional[torch.Tensor]) -> Prepared:
    """Metadata conversion, device ops only: the weights shuffled by aiter's own shuffle_weight (a copy
    of every local expert: a server would do it once per layer) and, with an expert map, ids and mask.

    aiter numbers local experts by a 0/1 mask over global ids, local = cumsum(mask) - 1 (torch_moe), so
    the map's own numbering (any order) is passed as "global" ids over a mask of E ones and one zero:
    a pair routed off-rank (-1) goes to id E, masked out, and contributes nothing."""
    from aiter.ops.shuffle import shuffle_weight

    w1s = shuffle_weight(x=w1.contiguous(), layout=SHUFFLE_LAYOUT)
    w2s = shuffle_weight(x=w2.contiguous(), layout=SHUFFLE_LAYOUT)
    if expert_map is None:
        return Prepared(w1s, w2s, topk_ids.contiguous(), None)
    experts = w1.shape[0]
    local = expert_map.to(torch.int64)[topk_ids.to(torch.int64)]
    ids = torch.where(local >= 0, local, experts).to(torch.int32)
    mask = torch.ones(experts + 1, dtype=torch.int32, device=topk_ids.device)
    mask[experts] = 0
    return Prepared(w1s, w2s, ids, mask)


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its kernels, for the bench to time apart: prepare's shuffle and ids."""
    if kwargs["hidden"].shape[0] == 0:
        return None
    return prepare(kwargs["w1"], kwargs["w2"], kwargs["topk_ids"], kwargs["expert_map"])


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
    """The spec's fused_moe on aiter's fused_moe; arguments are validated by the caller and accepted by
    ``supports``."""
    import aiter
    from aiter.fused_moe import fused_moe as aiter_fused_moe

    if hidden.shape[0] == 0:
        return hidden.new_empty(hidden.shape)
    prepared = prepare(w1, w2, topk_ids, expert_map)
    x, weights = hidden, topk_weights
    if apply_router_weight_on_input:
        # doweight_stage1 weights stage 1's output, not its input: the spec's W2 act(W1 (w x)) is had by
        # weighting x here (fp32 product, rounded to the hidden dtype as vLLM's prepare step does) and
        # passing unit router weights (k == 1, validate's rule).
        x = (hidden.float() * topk_weights).to(hidden.dtype)
        weights = torch.ones_like(topk_weights)
    x = x.contiguous()
    activation_type = aiter.ActivationType.Silu if activation == "silu" else aiter.ActivationType.Gelu
    block = quantization == "fp8_block"
    # per_128x128 weights: fused_moe remaps it to per_1x128 activations (quant_remap) and quantizes
    # them itself (a1_scale None: dynamic, per token and 128 columns).
    quant_type = aiter.QuantType.per_128x128 if block else aiter.QuantType.No
    variant = (quantization, hidden.dtype, activation, w1.shape[0], hidden.shape[1], w2.shape[2])

    def call():
        return aiter_fused_moe(
            hidden_states=x, w1=prepared.w1, w2=prepared.w2, topk_weight=weights.contiguous(),
            topk_ids=prepared.topk_ids, expert_mask=prepared.expert_mask, activation=activation_type,
            quant_type=quant_type, doweight_stage1=False,
            w1_scale=w1_scale.contiguous() if block else None, w2_scale=w2_scale.contiguous() if block else None,
            a1_scale=None, a2_scale=None, dtype=hidden.dtype,
        )

    return first_calls.run(AITER, spec.NAME, variant, WHERE + " (module_moe_sorting, module_moe_ck2stages_*)", call)
