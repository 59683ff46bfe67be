"""fused_moe: a token-routed mixture of experts (gate/up projection, gated activation, down
projection, router-weighted sum over each token's top-k experts), unquantized, with FP8
per-tensor or 128-block-scaled weights, or with MXFP4/NVFP4 weights (W4A16); the spec, its
reference and its cases."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import distinct_rule, enforce, index_rule, range_rule
from kernelmux.specs._compare import assert_close_to_magnitude, assert_same_kind
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_choice, check_tensor
from kernelmux.specs.fp4_mm import BLOCKS as FP4_BLOCKS, SCALE_DTYPES as FP4_SCALE_DTYPES, dequantize_fp4
from kernelmux.specs.quantize_fp8 import quantize_fp8
from kernelmux.specs.quantize_mxfp4 import quantize_mxfp4
from kernelmux.specs.quantize_nvfp4 import quantize_nvfp4

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "fused_moe"]

NAME = "fused_moe"
HIDDEN_DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = ("silu", "gelu")
# "none": weights in the hidden dtype; fp8 weights and activations; fp4 weights, activations in the
# hidden dtype (W4A16; version 2 added them and the global-scale arguments).
FP4_MODES = tuple(FP4_BLOCKS)  # "nvfp4", "mxfp4": fp4_mm's formats and block sizes
QUANTIZATIONS = ("none", "fp8_per_tensor", "fp8_block", *FP4_MODES)
# The fp8 weight formats; the activations are quantized to the same format as the weights.
FP8_NAMES = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}
BLOCK = 128  # fp8_block: 128 x 128 weight blocks, 1 x 128 activation groups (DeepSeek-V3)


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
    """``out[t] = sum_j w[t, j] * (act(x_t @ W1[e].T) @ W2[e].T)`` with ``e = topk_ids[t, j]``.

    Args:
        hidden: ``[T, H]`` bf16/fp16 (``x``), any strides; ``T >= 0``, ``H >= 1``.
        w1: ``[E, 2I, H]``: rows ``0..I-1`` of expert ``e`` are its gate projection, rows
            ``I..2I-1`` its up projection. The hidden dtype for ``quantization="none"``, else
            float8_e4m3fn or float8_e4m3fnuz (codes; ``W ~ codes * scale``) for the fp8 modes,
            uint8 ``[E, 2I, H/2]`` packed e2m1 codes (two per byte, element ``2j`` in the low
            nibble, as fp4_mm's ``b``) for the fp4 modes, which need ``H`` and ``I`` multiples
            of the block (32 mxfp4, 16 nvfp4).
        w2: ``[E, H, I]`` the down projections, the dtype of ``w1``; ``[E, H, I/2]`` packed
            for the fp4 modes.
        topk_weights: ``[T, k]`` fp32 router weights, used as given (no renormalization).
        topk_ids: ``[T, k]`` int32 *global* expert ids. Preconditions (checked in checked mode
            only, by ``check_data``: reading the values needs a device sync): every id in
            ``[0, E_global)`` and the ``k`` ids of a row distinct (as every router returns them).
        activation: ``"silu"``: ``silu(gate) * up``; ``"gelu"``: ``gelu(gate) * up`` with the
            exact (erf) GELU, as vLLM's ``GeluAndMul`` default.
        expert_map: ``[E_global]`` int32 or None. Global id -> local id in ``[0, E)``, or -1 when
            the expert lives on another rank: such a (token, expert) pair contributes zero.
            ``w1``/``w2`` then hold the ``E <= E_global`` local experts only. Without it,
            ``E_global = E`` and ids are local. Precondition (checked mode): values in
            ``[-1, E)``.
        apply_router_weight_on_input: multiply the expert's *input* by the router weight
            (``W2 act(W1 (w x))``, Llama-4) instead of its output. Only ``k == 1`` is accepted
            (validate rejects others), as vLLM asserts: then the weighted input is simply
            ``w[t, 0] * x_t``. The product is taken in fp32 and is what gets quantized.
        quantization: ``"none"``; ``"fp8_per_tensor"``: ``w1_scale``, ``w2_scale`` fp32 ``[E]``
            (one per expert and matrix); ``"fp8_block"``: ``w1_scale [E, ceil(2I/128),
            ceil(H/128)]``, ``w2_scale [E, ceil(H/128), ceil(I/128)]`` over 128 x 128 blocks of
            the ``[2I, H]`` and ``[H, I]`` matrices (a short last block uses its scale for the
            elements it has; with ``I % 128 != 0`` a block may straddle the gate/up boundary);
            ``"mxfp4"``: ``w1_scale [E, 2I, H/32]``, ``w2_scale [E, H, I/32]`` uint8 e8m0 codes
            (``W = e2m1 * 2^(code - 127)``); ``"nvfp4"``: ``w1_scale [E, 2I, H/16]``,
            ``w2_scale [E, H, I/16]`` float8_e4m3fn, with one fp32 global scale per expert and
            matrix (``W = e2m1 * sf / gs``). Block scales in fp4_mm's canonical linear layout,
            one row per output channel. Activations of the fp4 modes stay in the hidden dtype.
        w1_scale, w2_scale: dequantization scales as above; None for ``"none"``.
        w1_global_scale, w2_global_scale: ``"nvfp4"`` only (required there): fp32 ``[E]``, each
            expert matrix's ``gs`` as quantize_nvfp4 returns it; None otherwise.

    Activation quantization (fp8 modes), dynamic, inside the op, with quantize_fp8's reference
    (its rounding and scale floors) into the weights' fp8 format:
        ``fp8_block``: 1 x 128 groups per token (``per_group``) of the expert input ``[T, H]``
        and of the intermediate ``[T*k, I]`` (vLLM/SGLang/DeepGEMM for DeepSeek-V3).
        ``fp8_per_tensor``: one dynamic scale for the whole expert input ``[T, H]`` and one for
        the whole intermediate ``[T*k, I]``, whose pairs routed off-rank are zero rows (vLLM's
        ``Fp8MoEMethod`` with ``activation_scheme="dynamic"``: ``a1_scale``/``a2_scale`` None ->
        ``scaled_fp8_quant`` per tensor).

    Dataflow (what every fused kernel stores): the fp32 GEMM1 result is rounded to the hidden
    dtype, the activation is computed in fp32 from it and rounded to the hidden dtype (this is
    what the second fp8 quantization sees), GEMM2 accumulates in fp32, the router-weighted sum
    over ``j`` is fp32 and the output is rounded once. Kernels that fuse activation and
    quantization without that rounding, or round per-expert outputs before the sum, differ by
    rounding only (covered by check_close's tolerance).

    Returns:
        ``[T, H]`` in the dtype of ``hidden``.
    """
    weights, pairs, inter, _ = _route_and_activate(
        hidden, w1, topk_weights, topk_ids, activation, expert_map, apply_router_weight_on_input,
        quantization, w1_scale, w1_global_scale)
    out = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    for e, (tokens, slots) in pairs.items():
        down = inter[tokens, slots] @ _dequantize_weight(w2, w2_scale, e, quantization, w2_global_scale).T
        out.index_add_(0, tokens, down * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)


def _route_and_activate(hidden, w1, topk_weights, topk_ids, activation, expert_map,
                        apply_router_weight_on_input, quantization, w1_scale, w1_global_scale=None):
    """The reference up to the down projection: fp32 router weights [T, k] (ones when applied on
    the input), {local expert: (tokens, slots) routed to it}, the intermediate [T, k, I] as the
    down projection sees it (rounded to the hidden dtype, then fp8-quantized in fp8 modes), and
    |gate * up| / 4 [T, k] (check_close's floor of the intermediate's size)."""
    num_tokens = hidden.shape[0]
    inter_size = w1.shape[1] // 2
    dtype = hidden.dtype
    fp8_name = FP8_NAMES.get(w1.dtype, "e4m3fn")
    x = hidden.float()
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        x = x * weights  # [T, 1] (k == 1)
        weights = torch.ones_like(weights)
    x = _quantize_activations(x, quantization, fp8_name)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]  # -1: not on this rank
    inter = x.new_zeros((num_tokens, ids.shape[1], inter_size))
    floor = torch.zeros_like(inter)
    pairs = {}
    for e in (int(e) for e in ids.unique().tolist() if e >= 0):
        tokens, slots = pairs[e] = (ids == e).nonzero(as_tuple=True)
        gate_up = (x[tokens] @ _dequantize_weight(w1, w1_scale, e, quantization, w1_global_scale).T)
        gate_up = gate_up.to(dtype).float()
        gate, up = gate_up[:, :inter_size], gate_up[:, inter_size:]
        act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate)
        inter[tokens, slots] = (act * up).to(dtype).float()
        floor[tokens, slots] = 0.25 * (gate * up).abs()
    inter = _quantize_activations(inter.view(-1, inter_size), quantization, fp8_name).view(inter.shape)
    return weights, pairs, inter, floor


def _quantize_activations(x: torch.Tensor, quantization: str, fp8_name: str) -> torch.Tensor:
    """``x`` [M, K] fp32 quantized as the op does and dequantized back to fp32 (exact values)."""
    if quantization == "none" or quantization in FP4_MODES:  # W4A16: activations stay as they are
        return x
    if quantization == "fp8_block":
        q, scale = quantize_fp8(x, "per_group", BLOCK, False, fp8_name)
        return q.float() * scale.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    q, scale = quantize_fp8(x, "per_tensor", BLOCK, False, fp8_name)
    return q.float() * scale


def _dequantize_weight(
    w: torch.Tensor, scale: Optional[torch.Tensor], expert: int, quantization: str,
    global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Expert ``expert``'s matrix of ``w`` in fp32, dequantized."""
    if quantization in FP4_MODES:
        gs = global_scale[expert] if global_scale is not None else None
        return dequantize_fp4(w[expert], scale[expert], quantization, gs)
    matrix = w[expert].float()
    if quantization == "none":
        return matrix
    if quantization == "fp8_per_tensor":
        return matrix * scale[expert].float()
    rows, cols = matrix.shape
    blocks = scale[expert].float()
    full = blocks.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return matrix * full


def _block_scale_shape(experts: int, rows: int, cols: int) -> tuple[int, int, int]:
    return (experts, -(-rows // BLOCK), -(-cols // BLOCK))


def _check_scale(name: str, value: Any, shape: tuple, device: torch.device, what: str,
                 dtype: torch.dtype = torch.float32) -> None:
    if value is None:
        raise InvalidArgumentError(NAME, name, f"a {str(dtype)[6:]} tensor of shape {shape} ({what})", None)
    check_tensor(NAME, name, value, dtypes=(dtype,), shape=shape, device=device, meaning=what)


class Key(NamedTuple):
    """fused_moe's dispatch key: what an implementation may decide on (OpSpec.key). The expert
    counts and sizes are the model's (and the rank's); T (tokens) changes per batch and is a
    class (``size_class``)."""

    device: torch.device
    hidden_dtype: torch.dtype
    weight_dtype: torch.dtype  # w1's and w2's: hidden_dtype, an fp8 dtype, or uint8 (fp4, packed)
    quantization: str
    activation: str
    num_experts: int  # E, local: w1.shape[0]
    num_global_experts: int  # E_global: expert_map.shape[0], or E without a map
    hidden_size: int
    intermediate_size: int
    topk: int
    apply_router_weight_on_input: bool
    num_tokens_class: int
    hidden_layout: Layout
    w1_layout: Layout
    w2_layout: Layout
    topk_weights_layout: Layout
    topk_ids_layout: Layout
    expert_map_layout: Optional[Layout]  # None: no expert map
    w1_scale_layout: Optional[Layout]  # None: quantization "none"
    w2_scale_layout: Optional[Layout]
    w1_global_scale_layout: Optional[Layout]  # None unless quantization "nvfp4"
    w2_global_scale_layout: Optional[Layout]


def validate(
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
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "hidden", hidden, dtypes=HIDDEN_DTYPES, rank=2)
    device = hidden.device  # read once: building a torch.device costs ~0.3 us
    num_tokens, hidden_size = hidden.shape
    if hidden_size < 1:
        raise InvalidArgumentError(NAME, "hidden", "H = hidden.shape[1] >= 1", f"shape {tuple(hidden.shape)}")
    check_choice(NAME, "quantization", quantization, QUANTIZATIONS)
    fp4_block = FP4_BLOCKS.get(quantization)  # None: one weight element per tensor element
    if quantization == "none":
        weight_dtypes: tuple = (hidden.dtype,)
    elif fp4_block:
        weight_dtypes = (torch.uint8,)
        if hidden_size % fp4_block:
            raise InvalidArgumentError(NAME, "hidden", f"H = hidden.shape[1] a multiple of {fp4_block} "
                                       f"({quantization}'s block)", f"H = {hidden_size}")
    else:
        weight_dtypes = tuple(FP8_NAMES)
    pack = 2 if fp4_block else 1  # fp4: two codes per byte along K
    check_tensor(NAME, "w1", w1, dtypes=weight_dtypes, rank=3, device=device)
    experts, two_inter, w1_cols = w1.shape
    if experts < 1 or two_inter < 2 or two_inter % 2 or w1_cols != hidden_size // pack:
        raise InvalidArgumentError(
            NAME, "w1", f"shape (E >= 1, 2I >= 2 even, {hidden_size // pack}) (H = hidden.shape[1]"
            + (", two codes per byte)" if pack == 2 else ")"), f"shape {tuple(w1.shape)}",
        )
    inter_size = two_inter // 2
    if fp4_block and inter_size % fp4_block:
        raise InvalidArgumentError(NAME, "w1", f"2I with I a multiple of {fp4_block} ({quantization}'s block)",
                                   f"shape {tuple(w1.shape)}, I = {inter_size}")
    check_tensor(NAME, "w2", w2, dtypes=(w1.dtype,), shape=(experts, hidden_size, inter_size // pack),
                 device=device, meaning="E, H, I from w1 and hidden" + (", I packed two per byte" if pack == 2 else ""))
    check_tensor(NAME, "topk_weights", topk_weights, dtypes=(torch.float32,), rank=2, device=device)
    topk = topk_weights.shape[1]
    if topk_weights.shape[0] != num_tokens or topk < 1:
        raise InvalidArgumentError(
            NAME, "topk_weights", f"shape ({num_tokens}, k >= 1) (T = hidden.shape[0])",
            f"shape {tuple(topk_weights.shape)}",
        )
    check_tensor(NAME, "topk_ids", topk_ids, dtypes=(torch.int32,), rank=2, device=device)
    if topk_ids.shape != topk_weights.shape:
        raise InvalidArgumentError(
            NAME, "topk_ids", f"shape {tuple(topk_weights.shape)} (that of topk_weights)",
            f"shape {tuple(topk_ids.shape)}",
        )
    check_choice(NAME, "activation", activation, ACTIVATIONS)
    global_experts = experts
    if expert_map is not None:
        check_tensor(NAME, "expert_map", expert_map, dtypes=(torch.int32,), rank=1, device=device)
        global_experts = expert_map.shape[0]
        if global_experts < experts:
            raise InvalidArgumentError(
                NAME, "expert_map", f"shape (E_global,) with E_global >= E = {experts} (local experts)",
                f"shape {tuple(expert_map.shape)}",
            )
    if topk > global_experts:
        raise InvalidArgumentError(
            NAME, "topk_ids", f"k <= {global_experts} experts (ids of a row are distinct)",
            f"k = {topk}",
        )
    if type(apply_router_weight_on_input) is not bool:
        raise InvalidArgumentError(
            NAME, "apply_router_weight_on_input", "a bool", type(apply_router_weight_on_input).__name__
        )
    if apply_router_weight_on_input and topk != 1:
        raise InvalidArgumentError(
            NAME, "apply_router_weight_on_input", "False unless k = topk_ids.shape[1] is 1",
            f"True with k = {topk}", hint="as in vLLM, weighting the input is defined for top-1 only",
        )
    if quantization == "none":
        for name, value in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if value is not None:
                raise InvalidArgumentError(NAME, name, "None when quantization is 'none'", "a tensor")
    elif quantization == "fp8_per_tensor":
        _check_scale("w1_scale", w1_scale, (experts,), device, "fp8_per_tensor: one per expert")
        _check_scale("w2_scale", w2_scale, (experts,), device, "fp8_per_tensor: one per expert")
    elif quantization == "fp8_block":
        _check_scale("w1_scale", w1_scale, _block_scale_shape(experts, two_inter, hidden_size),
                     device, "fp8_block: [E, ceil(2I/128), ceil(H/128)]")
        _check_scale("w2_scale", w2_scale, _block_scale_shape(experts, hidden_size, inter_size),
                     device, "fp8_block: [E, ceil(H/128), ceil(I/128)]")
    else:
        scale_dtype = FP4_SCALE_DTYPES[quantization]
        _check_scale("w1_scale", w1_scale, (experts, two_inter, hidden_size // fp4_block), device,
                     f"{quantization}: [E, 2I, H/{fp4_block}]", scale_dtype)
        _check_scale("w2_scale", w2_scale, (experts, hidden_size, inter_size // fp4_block), device,
                     f"{quantization}: [E, H, I/{fp4_block}]", scale_dtype)
    for name, value in (("w1_global_scale", w1_global_scale), ("w2_global_scale", w2_global_scale)):
        if quantization == "nvfp4":
            _check_scale(name, value, (experts,), device, "nvfp4: one gs per expert")
        elif value is not None:
            raise InvalidArgumentError(NAME, name, f"None when quantization is {quantization!r}", "a tensor",
                                       hint="only nvfp4 weights have a global scale")
    return Key(
        device, hidden.dtype, w1.dtype, quantization, activation, experts, global_experts,
        hidden_size, inter_size, topk, apply_router_weight_on_input, size_class(num_tokens),
        layout(hidden), layout(w1), layout(w2), layout(topk_weights), layout(topk_ids),
        layout(expert_map), layout(w1_scale), layout(w2_scale), layout(w1_global_scale),
        layout(w2_global_scale),
    )


def check_data(
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
) -> None:
    """Checked mode: every routed id names an expert (global ids when there is a map), the ids
    of a row are distinct, and the map sends each global id to a local expert or to -1."""
    experts = w1.shape[0]
    if expert_map is None:
        bound, what = experts, f"the {experts} experts of w1"
    else:
        bound, what = expert_map.shape[0], f"the {expert_map.shape[0]} global experts of expert_map"
    rules = [
        index_rule("topk_ids", topk_ids, bound, what, negative_skips=False),
        distinct_rule("topk_ids", topk_ids, "a token routed twice to one expert",
                      negative_skips=False),
    ]
    if expert_map is not None:
        rules.append(range_rule("expert_map", expert_map, -1, experts,
                                f"-1: another rank's expert; else a local id < E = {experts}, "
                                "w1.shape[0]"))
    enforce(NAME, rules)


def fake(
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
    return hidden.new_empty(hidden.shape)


# Closeness: |actual - expected| <= atol * mag + rtol * |expected|, where
# mag[t, h] = sqrt(sum_{j, i} (w[t,j] * a[t,j,i] * W2[e][h, i])^2) is the L2 size of the terms of
# the down projection (a: the reference's intermediate, dequantized, but at least
# |gate * up| / 4: where act(gate) is tiny, e.g. gelu(-6) ~ -6e-9, which fp32's 1 + erf cancels to
# 0, a one-ulp change of the stored gate moves act by up to ~2^-8 |gate| and that sensitivity,
# not act's own size, bounds the difference). Rounding differences in the
# intermediate are independent across i, so they add up like an L2 norm, not like sum |.|; a
# wrong expert, slot or weight moves the output by ~mag, far outside the bound.
# - bf16: conforming kernels may land a stored intermediate (gate/up, act) one bf16 ulp
#   (<= 2^-8 relative) away, and may round each expert's output to bf16 before the k-sum (vLLM's
#   triton path + moe_sum): sum_j w_j 2^-9 |y_j| <= ~3 * 2^-9 sqrt(k) * mag at 3 sigma, 0.017 mag
#   for k = 8. Take atol 2^-5; rtol 1e-2 for the output rounding (1 ulp <= 2^-7 relative).
#   Measured: a kernel-like variant (no intermediate stores, per-expert rounding) reaches 0.4-0.6
#   of this bound on the cases. fp16: the same with 2^-10 ulps: atol 2^-7, rtol 2e-3.
# - fp8 modes (FP8_TOLERANCE): a kernel that quantizes an intermediate rounded differently (fused
#   act+quant without the bf16 store, w * x rounded to bf16 before quantization as vLLM's modular
#   prepare does) flips some fp8 codes by one e4m3 ulp (<= 2^-3 relative); such flips, plus the
#   bf16 terms above, stay below 2^-2 * mag (the variant reaches ~0.45 of it). A wrong expert,
#   slot, weight or scale moves outputs by ~mag or more, well outside.
# - fp4 modes (W4A16) take the bf16/fp16 bounds: the activations are not quantized and the weights
#   dequantize exactly (mxfp4: e2m1 times a power of two; nvfp4: one fp32 rounding of (e2m1 * sf) / gs,
#   which a kernel may apply after its dot instead, 2^-24 relative either way).
TOLERANCE = {
    torch.bfloat16: Tolerance(atol=2.0**-5, rtol=1e-2),
    torch.float16: Tolerance(atol=2.0**-7, rtol=2e-3),
}
FP8_TOLERANCE = {
    torch.bfloat16: Tolerance(atol=2.0**-2, rtol=1e-2),
    torch.float16: Tolerance(atol=2.0**-2, rtol=2e-3),
}


def magnitude(kwargs: Mapping[str, Any]) -> torch.Tensor:
    """mag [T, H] fp64 (see TOLERANCE), from the reference's own intermediate (with its floor)."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    weights, pairs, inter, floor = _route_and_activate(
        cpu["hidden"], cpu["w1"], cpu["topk_weights"], cpu["topk_ids"], cpu["activation"], cpu["expert_map"],
        cpu["apply_router_weight_on_input"], cpu["quantization"], cpu["w1_scale"], cpu.get("w1_global_scale"))
    inter = torch.maximum(inter.abs(), floor)
    square = torch.zeros(cpu["hidden"].shape, dtype=torch.float64)
    for e, (tokens, slots) in pairs.items():
        a = inter[tokens, slots] * weights[tokens, slots].unsqueeze(1)
        w = _dequantize_weight(cpu["w2"], cpu["w2_scale"], e, cpu["quantization"], cpu.get("w2_global_scale"))
        square.index_add_(0, tokens, (a.square() @ w.square().T).double())  # fp32 is plenty
    return square.sqrt()


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Elementwise within the tolerance of the hidden dtype and quantization, scaled by mag."""
    assert_same_kind(actual, expected, NAME)
    table = FP8_TOLERANCE if kwargs["quantization"].startswith("fp8") else TOLERANCE
    tolerance = table[expected.dtype]
    if expected.numel() == 0:
        return
    mag = magnitude(kwargs)
    assert_close_to_magnitude(
        actual, expected, mag, tolerance, f"{NAME} ({kwargs['quantization']})",
        "L2 of the down projection's terms",
    )


def cost(kwargs: Mapping[str, Any]) -> Cost:
    """FLOPs of the pairs routed to local experts; bytes of the experts at least one token uses.
    Reads topk_ids' values (on the host): cost is for the roofline, not the call path."""
    hidden, w1, w2 = kwargs["hidden"], kwargs["w1"], kwargs["w2"]
    num_tokens, hidden_size = hidden.shape
    inter_size = w1.shape[1] // 2
    ids = kwargs["topk_ids"].long().cpu()
    if kwargs["expert_map"] is not None:
        ids = kwargs["expert_map"].long().cpu()[ids]
    local = ids[ids >= 0]
    pairs, used = local.numel(), local.unique().numel()
    # GEMM1 2 * 2I * H, GEMM2 2 * H * I per pair; the activation and the sum are negligible.
    flops = pairs * 6 * hidden_size * inter_size
    scale_bytes = 0
    for name in ("w1_scale", "w2_scale", "w1_global_scale", "w2_global_scale"):
        scale = kwargs.get(name)
        if scale is not None:
            scale_bytes += scale[0].numel() * scale.element_size() * used
    bytes_moved = (
        hidden.numel() * hidden.element_size() * 2  # read x, write out
        + used * (w1[0].numel() * w1.element_size() + w2[0].numel() * w2.element_size())
        + scale_bytes
        + kwargs["topk_weights"].numel() * 4 + kwargs["topk_ids"].numel() * 4
        + (kwargs["expert_map"].numel() * 4 if kwargs["expert_map"] is not None else 0)
    )
    # W4A16 multiplies in the hidden dtype.
    return Cost(flops=flops, bytes=bytes_moved, matmul="fp8" if kwargs["quantization"].startswith("fp8") else "bf16")


# ---------------------------------------------------------------------------------------------
# Cases. Routing is drawn as a router would produce it: distinct top-k ids per row from random
# logits, weights their renormalized softmax. Real models' weights are gigabytes, so the model
# cases hold an expert-parallel slice of them (expert_map with the rank's contiguous block of
# experts; the routing still spans all experts) and few tokens, so the reference runs in about
# a second on a 2-core CPU; ``local_experts`` and ``tokens`` are the knobs the perf suite scales.


def _routing(tokens: int, global_experts: int, topk: int, generator: torch.Generator):
    logits = torch.randn(tokens, global_experts, generator=generator)
    values, ids = logits.topk(topk, dim=-1)
    return values.softmax(dim=-1), ids.to(torch.int32)


def _weights(experts: int, rows: int, cols: int, dtype: torch.dtype, generator: torch.Generator):
    # Trained-layer magnitudes: std 1/sqrt(fan-in) (uniform, drawn directly in the dtype: fast).
    bound = (3.0 / cols) ** 0.5
    return torch.empty(experts, rows, cols, dtype=dtype).uniform_(-bound, bound, generator=generator)


def _quantize_weights(w: torch.Tensor, quantization: str, fp8_name: str):
    """w [E, N, K] -> (codes, scales) in the layout of an fp8 ``quantization``, via quantize_fp8."""
    if quantization == "fp8_per_tensor":
        pairs = [quantize_fp8(m, "per_tensor", BLOCK, False, fp8_name) for m in w]
        return torch.stack([q for q, _ in pairs]), torch.cat([s for _, s in pairs])
    from kernelmux.specs.scaled_mm import quantize_weight_blocks

    pairs = [quantize_weight_blocks(m, False, fp8_name) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _quantize_fp4_weights(w: torch.Tensor, quantization: str):
    """w [E, N, K] -> (packed codes [E, N, K/2], block scales [E, N, K/block], global scales [E]
    for nvfp4 else None), expert by expert, via quantize_mxfp4 (OCP floor rounding) or quantize_nvfp4
    (a dynamic gs per expert matrix, as NVFP4 checkpoints hold)."""
    if quantization == "mxfp4":
        pairs = [quantize_mxfp4(m) for m in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]), None
    triples = [quantize_nvfp4(m) for m in w]
    return (torch.stack([q for q, _, _ in triples]), torch.stack([s for _, s, _ in triples]),
            torch.stack([g.reshape(()) for _, _, g in triples]))


def _maker(
    tokens: int,
    experts: int,
    topk: int,
    hidden_size: int,
    inter_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    activation: str = "silu",
    quantization: str = "none",
    fp8_name: str = "e4m3fn",
    local_experts: Optional[int] = None,
    unmapped: int = 0,
    on_input: bool = False,
    one_expert: bool = False,
):
    """``experts`` global experts; ``local_experts`` (with an expert_map) of them on this rank,
    a contiguous block holding token 0's first expert (so some pairs are local); ``unmapped``
    extra -1 entries scattered in the map (model cases leave them 0)."""

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = torch.randn(tokens, hidden_size, generator=generator)
        if hidden_size >= 16:
            x[:, torch.randint(0, hidden_size, (max(hidden_size // 512, 1),), generator=generator)] *= 20.0
        x = x.to(dtype)
        weights, ids = _routing(tokens, experts, topk, generator)
        if one_expert:
            ids[:, 0] = experts - 1
            ids[:, 1:] = torch.arange(topk - 1, dtype=torch.int32)  # distinct, != experts - 1
        expert_map = None
        local = experts
        if local_experts is not None:
            local = local_experts
            anchor = int(ids[0, 0]) if tokens else 0
            start = min(anchor // local * local, experts - local)
            expert_map = torch.full((experts,), -1, dtype=torch.int32)
            expert_map[start:start + local] = torch.arange(local, dtype=torch.int32)
        elif unmapped:
            # A map over all E experts with `unmapped` of them marked off-rank (-1), the rest
            # shuffled (local ids need not follow global order).
            local = experts - unmapped
            perm = torch.randperm(experts, generator=generator)
            expert_map = torch.full((experts,), -1, dtype=torch.int32)
            expert_map[perm[:local]] = torch.arange(local, dtype=torch.int32)
        w1_scale = w2_scale = w1_global = w2_global = None
        if quantization == "none":
            w1 = _weights(local, 2 * inter_size, hidden_size, dtype, generator)
            w2 = _weights(local, hidden_size, inter_size, dtype, generator)
        else:
            w1 = _weights(local, 2 * inter_size, hidden_size, torch.bfloat16, generator)
            w2 = _weights(local, hidden_size, inter_size, torch.bfloat16, generator)
            # Per-expert spread of magnitudes, so that the scales differ between experts.
            w1 = w1 * (torch.rand(local, 1, 1, generator=generator) + 0.5).to(torch.bfloat16)
            if quantization in FP4_MODES:
                w1, w1_scale, w1_global = _quantize_fp4_weights(w1, quantization)
                w2, w2_scale, w2_global = _quantize_fp4_weights(w2, quantization)
            else:
                w1, w1_scale = _quantize_weights(w1, quantization, fp8_name)
                w2, w2_scale = _quantize_weights(w2, quantization, fp8_name)
        if on_input:
            weights = torch.rand(tokens, topk, generator=generator) + 0.5
        tensors = {
            "hidden": x, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids,
            "expert_map": expert_map, "w1_scale": w1_scale, "w2_scale": w2_scale,
            "w1_global_scale": w1_global, "w2_global_scale": w2_global,
        }
        moved = {k: v.to(device) if v is not None else None for k, v in tensors.items()}
        return {
            **moved,
            "activation": activation,
            "apply_router_weight_on_input": on_input,
            "quantization": quantization,
        }

    return make


def _cases() -> tuple[Case, ...]:
    quick = frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    cases = [
        Case("qwen3_30b_a3b_t16_ep16", _maker(16, 128, 8, 2048, 768, local_experts=8), quick,
             "Qwen3-30B-A3B (E 128, top 8, H 2048, I 768), 16 tokens; weights sliced to one "
             "expert-parallel rank's 8 experts (EP 16) via expert_map, routing over all 128"),
        Case("mixtral_8x7b_t4_ep8", _maker(4, 8, 2, 4096, 14336, local_experts=1), quick,
             "Mixtral-8x7B (E 8, top 2, H 4096, I 14336), 4 tokens; one expert per rank (EP 8): "
             "a single expert is 350 MB of bf16"),
        Case("deepseek_v3_t16_fp8_block_ep256", _maker(16, 256, 8, 7168, 2048, local_experts=1,
                                                        quantization="fp8_block"), quick,
             "DeepSeek-V3 (E 256, top 8, H 7168, I 2048) with its 128-block fp8 weights and "
             "1x128 dynamic activations, 16 tokens; sliced to one local expert (EP 256)"),
        Case("gpt_oss_120b_t8_bf16_ep32", _maker(8, 128, 4, 2880, 2880, local_experts=4), quick,
             "gpt-oss-120b's shape (E 128, top 4, H 2880, I 2880; H not a multiple of 128) in "
             "bf16, 8 tokens, 4 local experts (EP 32)"),
        Case("gpt_oss_120b_t8_mxfp4_ep32",
             _maker(8, 128, 4, 2880, 2880, local_experts=4, quantization="mxfp4"), quick,
             "gpt-oss-120b with MXFP4 experts (W4A16, bf16 activations; silu, not gpt-oss's clamped "
             "swiglu with biases), 8 tokens, 4 local experts (EP 32)"),
        Case("small_silu", _maker(7, 8, 2, 64, 48), random, "bf16, no map, odd T"),
        Case("small_gelu_fp16", _maker(5, 6, 3, 40, 24, dtype=torch.float16, activation="gelu"),
             random, "fp16 with the erf GELU, E and H not powers of two"),
        Case("small_fp8_per_tensor", _maker(6, 8, 2, 96, 64, quantization="fp8_per_tensor"),
             random, "per-tensor fp8 weights, dynamic per-tensor activations"),
        Case("small_fp8_block", _maker(6, 6, 2, 256, 128, quantization="fp8_block"), random,
             "two 1x128 hidden groups, 2 x 2 w1 blocks, 2 x 1 w2 blocks"),
        Case("small_fp8_block_fnuz_gelu",
             _maker(4, 4, 2, 256, 128, quantization="fp8_block", fp8_name="e4m3fnuz",
                    activation="gelu"), random, "e4m3fnuz weights and activations (gfx942)"),
        Case("small_fp8_per_tensor_fnuz_fp16",
             _maker(5, 4, 2, 64, 32, quantization="fp8_per_tensor", fp8_name="e4m3fnuz",
                    dtype=torch.float16), random, "e4m3fnuz, fp16 hidden"),
        Case("small_mxfp4", _maker(7, 8, 2, 96, 64, quantization="mxfp4"), random,
             "MXFP4 weights (blocks of 32, e8m0 scales), bf16 activations"),
        Case("small_nvfp4_gelu_fp16",
             _maker(6, 6, 3, 64, 48, quantization="nvfp4", dtype=torch.float16, activation="gelu"),
             random, "NVFP4 weights (blocks of 16, e4m3 scales, a global scale per expert), fp16"),
        Case("empty", _maker(0, 8, 2, 64, 32), edge, "T = 0: an empty batch gives [0, H]"),
        Case("empty_fp8_block", _maker(0, 4, 2, 128, 128, quantization="fp8_block"), edge,
             "T = 0 with block quantization (no groups to quantize)"),
        Case("one_token", _maker(1, 16, 4, 64, 32), edge, "T = 1: a decode step"),
        Case("expert_map_with_holes", _maker(9, 12, 3, 64, 32, unmapped=5), edge,
             "expert_map over 12 experts, 5 of them -1 (other ranks), local ids shuffled"),
        Case("expert_map_holes_fp8_per_tensor",
             _maker(9, 12, 3, 64, 32, unmapped=4, quantization="fp8_per_tensor"), edge,
             "off-rank pairs are zero rows of the per-tensor-quantized intermediate"),
        Case("all_tokens_one_expert", _maker(11, 8, 3, 64, 32, one_expert=True), edge,
             "every token routed to expert 7 (and 0, 1): one expert takes the whole batch"),
        Case("top1_weight_on_input", _maker(6, 8, 1, 64, 32, on_input=True), edge,
             "apply_router_weight_on_input with top-1 (Llama-4): weights in [0.5, 1.5)"),
        Case("top1_weight_on_input_fp8_block",
             _maker(6, 4, 1, 128, 128, on_input=True, quantization="fp8_block"), edge,
             "the router weight scales the input before its 1x128 quantization"),
        Case("fp8_block_h_i_not_multiple_of_128",
             _maker(5, 4, 2, 200, 100, quantization="fp8_block"), edge,
             "H = 200, I = 100: short last groups and blocks; a w1 block straddles gate and up"),
        Case("fp8_block_below_one_block",
             _maker(3, 3, 2, 72, 40, quantization="fp8_block", activation="gelu"), edge,
             "H and I below 128: one short group/block each"),
        Case("topk_equals_experts", _maker(4, 4, 4, 64, 32), edge, "k = E: every expert used"),
        Case("mxfp4_expert_map_holes", _maker(9, 12, 3, 64, 32, unmapped=5, quantization="mxfp4"), edge,
             "MXFP4 at the smallest sizes (H 64, I 32: one block of I), 5 of 12 experts on other ranks"),
        Case("nvfp4_top1_weight_on_input",
             _maker(6, 4, 1, 32, 16, on_input=True, quantization="nvfp4"), edge,
             "NVFP4 with one block of I; the router weight scales the bf16 input (not quantized)"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn MoE layers: 0-40 tokens, 1-8 experts, any top-k, hidden and intermediate sizes of
    16-256, both activations, every quantization, expert-parallel holes, router weight on input."""
    tokens = draw(st.integers(0, 40))
    experts = draw(st.integers(1, 8))
    topk = draw(st.integers(1, experts))
    quantization = draw(st.sampled_from(QUANTIZATIONS))
    sizes = [32, 128, 256] if quantization == "mxfp4" else [16, 128, 256]  # mxfp4: blocks of 32
    hidden = draw(st.sampled_from(sizes))
    inter = draw(st.sampled_from(sizes))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    activation = draw(st.sampled_from(["silu", "gelu"]))
    unmapped = draw(st.integers(0, experts - 1)) if experts > 1 else 0
    on_input = topk == 1 and draw(st.booleans())
    return drawn(f"T {tokens}, E {experts} ({unmapped} on other ranks), top-{topk}, H {hidden}, I {inter}, "
                 f"{str(dtype)[6:]}, {activation}, {quantization}, weight on input {on_input}",
                 _maker(tokens, experts, topk, hidden, inter, dtype=dtype, activation=activation,
                        quantization=quantization, unmapped=unmapped, on_input=on_input))


SPEC = OpSpec(
    name=NAME,
    version=2,  # 2: the fp4 modes and the global-scale arguments
    reference=fused_moe,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    check_data=check_data,
    shapes=_shapes,
)
