"""The cpu backend's fused_moe: the (token, expert) pairs grouped per expert on the host, each used
expert's weights read once (a GEMM in their own dtype for a few rows, else converted to fp32 a chunk
at a time, fp8 and fp4 codes dequantized exactly), one activation pass and one weighted index_add_."""

# Where the reference converts each used expert's whole matrices to fp32 (`w[e].float()`, a 2x
# larger copy written to memory and read back, and for fp8 torch's one-element-at-a-time cast):
# - "none" with at most _DIRECT_MAX_ROWS rows on an expert: torch's bf16/fp16 GEMM (fp32
#   accumulation, one rounding to the weights' dtype: exactly the spec's stored GEMM1 result; for
#   GEMM2 the per-expert rounding that check_close allows) reads the weights once, in place;
# - otherwise (more rows, or fp8 weights): the matrix is converted to fp32 _CHUNK_ELEMENTS at a
#   time into one reused buffer (fp8 through _fp8's exact integer route, then scaled in place: the
#   reference's dequantized values, bit for bit) and multiplied there by fp32 GEMMs, so the fp32
#   copy stays in cache. Weights of at most _CHUNK_ELEMENTS in all are converted once for every
#   expert: small layers are bound by the number of torch calls, not by bytes.
# - fp4 (W4A16): packed codes decoded to fp32 a chunk of rows at a time into reused buffers, through
#   _fp4's byte -> (low, high) value-pair table, times the block scales in the reference's order of
#   operations: its dequantized values, bit for bit; fp32 GEMMs as above.
#   Weights of at most _CHUNK_ELEMENTS in all are decoded once for every expert, as fp8's.
# Activations are quantized by the spec's own helper over the same rows as the reference (the
# whole [T, H] input; the intermediate's local pairs only, as the reference's off-rank rows are
# zeros and change neither a per-tensor amax nor any 1 x 128 group).

from __future__ import annotations

from typing import Optional

import torch

from kernelmux.backends.cpu._fp4 import decode_experts as fp4_decode_experts
from kernelmux.backends.cpu._fp4 import gemm as fp4_gemm
from kernelmux.backends.cpu._fp8 import ROUTE_SCALES, fp8_as_half
from kernelmux.backends.cpu._gemm import padded_rows
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.fp4_mm import BLOCKS as FP4_BLOCKS

__all__ = ["fused_moe"]

# "none": experts with at most this many rows run torch's GEMM in the weights' dtype; more rows
# convert the weights to fp32 first. torch's bf16 GEMM costs ~0.14 ns per weight element per row,
# converting and fp32 GEMMs ~0.3-0.45 at 1-4 rows, less per row after: Mixtral's w1 (28672 x
# 4096) direct 16 / 26 / 38 / 50 / 74 ms at 1 / 2 / 3 / 4 / 6 rows, converted 37 / 50 / 50 /
# 50 / 66 ms, perf/decisions/fused_moe.md.
_DIRECT_MAX_ROWS = 3
# Weights converted to fp32 per GEMM, rounded to whole 128-row blocks (fp8_block's scale rows):
# 4 MiB of fp32, in the 32 MiB L3. DeepSeek-V3's fp8 w2 (7168 x 2048), one row: 16.2 / 14.4 /
# 10.0 / 7.9 / 7.9 / 15.7 ms at 128K / 256K / 512K / 1M / 2M / 4M elements; Mixtral's bf16 w1
# converted: 39.5 / 39.8 / 39.6 / 35.1 / 35.4 / 51.4 ms, perf/decisions/fused_moe.md.
_CHUNK_ELEMENTS = 1 << 20
_BLOCK = spec.BLOCK


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
    """The spec's fused_moe on CPU tensors; arguments are validated by the caller."""
    num_tokens, hidden_size = hidden.shape
    experts, inter_size = w1.shape[0], w1.shape[1] // 2
    topk = topk_ids.shape[1]
    dtype = hidden.dtype
    out = torch.zeros((num_tokens, hidden_size), dtype=torch.float32)

    # Pairs (token, slot) in row-major order, grouped by local expert; off-rank pairs (-1) sort
    # first and are dropped. Values are read on the host: a CPU has no sync to avoid.
    ids = topk_ids.long().reshape(-1)
    if expert_map is not None:
        ids = expert_map.long()[ids]
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids + 1, minlength=experts + 1).tolist()
    order = order[counts[0]:]
    if order.numel() == 0:
        return out.to(dtype)
    tokens = order // topk
    spans = []  # (expert, its rows of the pairs)
    first = 0
    for expert, rows in enumerate(counts[1:]):
        if rows:
            spans.append((expert, slice(first, first + rows)))
            first += rows

    x = hidden.float()
    weights = topk_weights.reshape(-1).float()[order]
    if apply_router_weight_on_input:
        x = x * topk_weights.float()  # [T, 1]: k == 1, the product in fp32
    fp8_name = spec.FP8_NAMES.get(w1.dtype, "e4m3fn")
    # "none": GEMMs in the weights' dtype read the unweighted input; the router weight, when it
    # applies to the input, multiplies their result before its rounding (one ulp from the spec's
    # at most, as any rounded product).
    direct = hidden[tokens] if quantization == "none" else None
    gate_up = _expert_gemms(spec._quantize_activations(x, quantization, fp8_name)[tokens], direct,
                            w1, w1_scale, quantization, spans, w1_global_scale)
    if direct is not None and apply_router_weight_on_input:
        for _, span in spans:
            if span.stop - span.start <= _DIRECT_MAX_ROWS:
                gate_up[span] *= weights[span, None]
    gate_up = gate_up.to(dtype).float()  # the stored GEMM1 result

    gate, up = gate_up[:, :inter_size], gate_up[:, inter_size:]
    gated = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate)
    inter = gated.mul_(up).to(dtype)
    a2 = spec._quantize_activations(inter.float(), quantization, fp8_name)
    down = _expert_gemms(a2, inter if quantization == "none" else None, w2, w2_scale, quantization, spans,
                         w2_global_scale)
    if not apply_router_weight_on_input:
        down.mul_(weights.unsqueeze(1))
    out.index_add_(0, tokens, down)
    return out.to(dtype)


def _expert_gemms(a: torch.Tensor, a_half: Optional[torch.Tensor], w: torch.Tensor,
                  scale: Optional[torch.Tensor], quantization: str,
                  spans: list[tuple[int, slice]], global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[P, N]`` fp32: each span's rows of ``a [P, K]`` (fp32) times the transpose of its expert's
    matrix of ``w [E, N, K]`` (fp4: ``[E, N, K/2]`` packed), dequantized. ``a_half`` (quantization
    "none": the same rows in the weights' dtype) serves the spans of at most _DIRECT_MAX_ROWS rows,
    through a GEMM in that dtype."""
    _, rows, cols = w.shape
    result = torch.empty((a.shape[0], rows), dtype=torch.float32)
    whole = None  # every expert dequantized at once, when w is that small
    fp4 = quantization in FP4_BLOCKS
    for expert, span in spans:
        if fp4 and 2 * w.numel() > _CHUNK_ELEMENTS:
            gs = global_scale[expert] if global_scale is not None else None
            result[span] = fp4_gemm(a[span], w[expert], scale[expert], gs, quantization, _CHUNK_ELEMENTS)
        elif fp4:
            if whole is None:
                whole = fp4_decode_experts(w, scale, global_scale, quantization)
            torch.mm(a[span], whole[expert].T, out=result[span])
        elif a_half is not None and span.stop - span.start <= _DIRECT_MAX_ROWS:
            result[span] = torch.mm(a_half[span], w[expert].T)
        elif w.numel() <= _CHUNK_ELEMENTS:
            if whole is None:
                whole = _dequantize(w.reshape(-1, cols), _row_scales(scale, quantization, rows),
                                    torch.empty(w.numel(), dtype=torch.float32)).view(w.shape)
            torch.mm(a[span], whole[expert].T, out=result[span])
        else:
            result[span] = _chunked_gemm(a[span], w[expert], scale, quantization, expert)
    return result


def _row_scales(scale: Optional[torch.Tensor], quantization: str, rows: int) -> Optional[torch.Tensor]:
    """The scales of every expert's rows, in the order of ``w.reshape(-1, K)``: ``[E * N, 1]`` (per
    tensor) or ``[E * N, ceil(K/128)]`` (blocks); None for "none"."""
    if quantization == "none":
        return None
    if quantization == "fp8_per_tensor":
        return scale.view(-1, 1).repeat_interleave(rows, dim=0)
    return scale.repeat_interleave(_BLOCK, dim=1)[:, :rows].reshape(-1, scale.shape[2])


def _expert_row_scales(scale: Optional[torch.Tensor], quantization: str, expert: int, first: int,
                       count: int) -> Optional[torch.Tensor]:
    """The scales of rows ``first..first+count`` (``first`` a multiple of 128) of expert ``expert``'s
    matrix: ``[1, 1]`` (per tensor, broadcast), ``[count, ceil(K/128)]`` (blocks) or None."""
    if quantization == "none":
        return None
    if quantization == "fp8_per_tensor":
        return scale[expert:expert + 1].view(1, 1)
    blocks = scale[expert, first // _BLOCK: -(-(first + count) // _BLOCK)]
    return blocks.repeat_interleave(_BLOCK, dim=0)[:count]


def _chunked_gemm(a: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor], quantization: str,
                  expert: int) -> torch.Tensor:
    """``a [M, K]`` fp32 @ ``W.T`` -> ``[M, N]`` fp32, where ``W`` is expert ``expert``'s ``w [N,
    K]`` dequantized to fp32 ``_CHUNK_ELEMENTS`` at a time."""
    rows, cols = w.shape
    tokens = a.shape[0]
    a = padded_rows(a)
    padded = a.shape[0]
    step = min(rows, max(_BLOCK, _CHUNK_ELEMENTS // cols // _BLOCK * _BLOCK))
    buffer = torch.empty(step * cols, dtype=torch.float32)
    scratch = torch.empty(step * cols, dtype=torch.int16) if quantization != "none" else None
    result = torch.empty((rows, padded), dtype=torch.float32)  # transposed: chunks are rows
    for first in range(0, rows, step):
        chunk = w[first:first + step]
        count = chunk.shape[0]
        dequantized = _dequantize(chunk, _expert_row_scales(scale, quantization, expert, first, count),
                                  buffer, scratch)
        torch.mm(dequantized, a.T, out=result[first:first + count])
    return result[:, :tokens].T


def _dequantize(codes: torch.Tensor, row_scales: Optional[torch.Tensor], buffer: torch.Tensor,
                scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``codes [n, K]`` (the hidden dtype, or fp8) times ``row_scales`` (``[n or 1, 1]``: one per
    row; ``[n, ceil(K/128)]``: one per row and 128 columns; None: unscaled) in fp32, in ``buffer``'s
    memory, as the reference's ``_dequantize_weight`` computes them: the fp8 route's power-of-two
    factor folds into the scale, so every product is the reference's, rounded once."""
    rows, cols = codes.shape
    out = buffer[: codes.numel()].view(rows, cols)
    if row_scales is None:
        return out.copy_(codes)
    if scratch is None:
        scratch = torch.empty(codes.numel(), dtype=torch.int16)
    # Converted, then scaled in place: torch.mul of fp16 by fp32 into fp32 would first make a
    # converted copy of its own (27 against 21 ms for DeepSeek-V3's w1, one token).
    out.copy_(fp8_as_half(codes, scratch))
    factor = row_scales * ROUTE_SCALES[codes.dtype]
    width = cols if factor.shape[1] == 1 else _BLOCK  # one scale per row, or per 128 columns
    whole = cols // width * width
    if whole:
        out[:, :whole].view(rows, whole // width, width).mul_(factor[:, : whole // width, None])
    if whole < cols:
        out[:, whole:].mul_(factor[:, -1:])
    return out
