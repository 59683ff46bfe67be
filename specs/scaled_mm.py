"""scaled_mm: the FP8 GEMM ``dequant(a) @ dequant(b).T (+ bias)`` with per-tensor, per-token x
per-channel or 128-block scales; the spec, its reference and its cases."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close_to_magnitude, assert_same_kind
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, drawn, shapes_strategy
from kernelmux.specs._tolerance import GEMM_OUTPUT
from kernelmux.specs._validate import check_choice, check_tensor
from kernelmux.specs.quantize_fp8 import quantize_fp8

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "scaled_mm"]

NAME = "scaled_mm"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# The API names the output dtype with a string (a torch.dtype is not a custom-op argument type).
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BLOCK = 128  # a: 1 x 128 groups along K; b: 128 x 128 blocks (DeepSeek-V3 weight_scale_inv)
# The scale layouts, in the order they are tried: per-tensor; per-token a x per-channel b;
# block. When K <= 128 and N == 1 the "channel" and "block" shapes coincide; the math is then the
# same, and the call is called "channel".
LAYOUTS = ("tensor", "channel", "block")


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FP8 matrix multiply with dequantization scales: ``(a * scale_a) @ (b * scale_b).T + bias``.

    Args:
        a: ``[M, K]`` float8_e4m3fn or float8_e4m3fnuz (activations), any strides; ``M >= 0``.
        b: ``[N, K]`` the same fp8 dtype as ``a`` (weights, one row per output channel).
        scale_a, scale_b: fp32 dequantization scales (``x ~ q * scale``) in one layout:
            per-tensor: ``[]`` or ``[1]`` each;
            per-token x per-channel: ``scale_a [M, 1]``, ``scale_b [N, 1]``;
            block: ``scale_a [M, ceil(K / 128)]`` (1 x 128 groups of a row),
            ``scale_b [ceil(N / 128), ceil(K / 128)]`` (128 x 128 blocks); a short last group or
            block along K or N uses its scale for the elements it has.
            Power-of-two (UE8M0) scales are just fp32 values here.
        out_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        bias: ``[N]`` in ``out_dtype``, or None; added in fp32 before the single output rounding.

    Returns:
        ``[M, N]`` in ``out_dtype``: the product computed in fp32 and rounded once.
    """
    deq_a, deq_b = dequantize_operands(a, b, scale_a, scale_b)
    out = deq_a @ deq_b.T
    if bias is not None:
        out = out + bias.float()
    return out.to(OUT_DTYPES[out_dtype])


def dequantize_operands(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a * scale_a`` and ``b * scale_b`` in fp32, each scale broadcast over its layout."""
    rows, cols = a.shape
    channels = b.shape[0]
    layout = scale_layout(a, b, scale_a, scale_b)
    sa, sb = scale_a.float(), scale_b.float()
    if layout == "tensor":
        sa, sb = sa.reshape(()), sb.reshape(())
    elif layout == "block":
        sa = sa.repeat_interleave(BLOCK, dim=1)[:, :cols]
        sb = sb.repeat_interleave(BLOCK, dim=0)[:channels].repeat_interleave(BLOCK, dim=1)[:, :cols]
    return a.float() * sa, b.float() * sb


def _layout_shapes(rows: int, channels: int, cols: int) -> dict[str, tuple[tuple, tuple]]:
    """Per layout: the allowed shapes of scale_a and of scale_b."""
    k_blocks = -(-cols // BLOCK)
    return {
        "tensor": (((), (1,)), ((), (1,))),
        "channel": (((rows, 1),), ((channels, 1),)),
        "block": (((rows, k_blocks),), ((-(-channels // BLOCK), k_blocks),)),
    }


def _describe(shapes: tuple) -> str:
    return " or ".join(str(s) for s in shapes)


def scale_layout(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> str:
    """The layout the scale shapes name (one of LAYOUTS); InvalidArgumentError when none fits."""
    rows, cols = a.shape
    channels = b.shape[0]
    shape_a, shape_b = tuple(scale_a.shape), tuple(scale_b.shape)
    table = _layout_shapes(rows, channels, cols)
    for layout in LAYOUTS:
        allowed_a, allowed_b = table[layout]
        if shape_a in allowed_a and shape_b in allowed_b:
            return layout
    fits_a = [layout for layout in LAYOUTS if shape_a in table[layout][0]]
    if not fits_a:
        expected = "; ".join(f"{_describe(table[l][0])} ({l})" for l in LAYOUTS)
        raise InvalidArgumentError(
            NAME, "scale_a", f"a shape in {expected} for M={rows}, K={cols}", shape_a
        )
    fits_b = [layout for layout in LAYOUTS if shape_b in table[layout][1]]
    if not fits_b:
        expected = "; ".join(f"{_describe(table[l][1])} ({l})" for l in LAYOUTS)
        raise InvalidArgumentError(
            NAME, "scale_b", f"a shape in {expected} for N={channels}, K={cols}", shape_b
        )
    wanted = " or ".join(f"{_describe(table[l][1])} ({l})" for l in fits_a)
    raise InvalidArgumentError(
        NAME, "scale_b", f"the layout of scale_a {shape_a}: a shape {wanted}",
        f"{shape_b} ({', '.join(fits_b)} layout)",
        hint="a and b must use the same scale layout",
    )


def validated_scaling(scale_a: torch.Tensor, scale_b: torch.Tensor, channels: int) -> str:
    """scale_layout's answer for a call that validate accepted (N = ``channels``), from the scales' ranks
    and scale_b's shape alone: no checks and no shape tables on an implementation's hot path. Where the
    channel and block shapes coincide (N = 1, K <= 128) it says "channel", as scale_layout does."""
    if scale_a.dim() < 2:
        return "tensor"
    return "channel" if tuple(scale_b.shape) == (channels, 1) else "block"


def _check_scale(name: str, value: Any, device: torch.device) -> None:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(NAME, name, "a torch.Tensor", type(value).__name__)
    if value.dtype != torch.float32:
        raise InvalidArgumentError(NAME, name, "dtype float32", value.dtype)
    if value.device != device:
        raise InvalidArgumentError(
            NAME, name, f"a tensor on {device} (the device of the first input)", value.device
        )


class Key(NamedTuple):
    """scaled_mm's dispatch key: what an implementation may decide on (OpSpec.key). N and K are
    the weight's, fixed per layer; M (tokens) changes per batch and is a class (``size_class``)."""

    device: torch.device
    fp8_dtype: torch.dtype  # a's and b's
    scaling: str  # the scale layout, one of LAYOUTS
    out_dtype: str
    bias_dtype: Optional[torch.dtype]  # None: no bias
    n: int
    k: int
    m_class: int
    a_layout: Layout
    b_layout: Layout
    scale_a_layout: Layout
    scale_b_layout: Layout
    bias_layout: Optional[Layout]


def validate(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "a", a, dtypes=FP8_DTYPES, rank=2)
    device = a.device  # read once: building a torch.device costs ~0.3 us
    check_tensor(NAME, "b", b, dtypes=FP8_DTYPES, rank=2, device=device)
    if b.dtype != a.dtype:
        raise InvalidArgumentError(NAME, "b", f"dtype {a.dtype} (the dtype of a)", b.dtype)
    cols = a.shape[1]
    if cols < 1:
        raise InvalidArgumentError(NAME, "a", "K = a.shape[1] >= 1", f"shape {tuple(a.shape)}")
    channels = b.shape[0]
    if b.shape[1] != cols:
        raise InvalidArgumentError(
            NAME, "b", f"shape (N, {cols}) (K = a.shape[1])", f"shape {tuple(b.shape)}"
        )
    if channels < 1:
        raise InvalidArgumentError(NAME, "b", "N = b.shape[0] >= 1", f"shape {tuple(b.shape)}")
    _check_scale("scale_a", scale_a, device)
    _check_scale("scale_b", scale_b, device)
    scaling = scale_layout(a, b, scale_a, scale_b)
    check_choice(NAME, "out_dtype", out_dtype, OUT_DTYPES)
    bias_dtype = None
    if bias is not None:
        # The bias is in the output dtype (vLLM's and CUTLASS's convention).
        check_tensor(NAME, "bias", bias, dtypes=(OUT_DTYPES[out_dtype],), rank=1, device=device)
        if bias.shape[0] != channels:
            raise InvalidArgumentError(
                NAME, "bias", f"shape ({channels},) to match N = b.shape[0]", tuple(bias.shape)
            )
        bias_dtype = bias.dtype
    return Key(
        device, a.dtype, scaling, out_dtype, bias_dtype, channels, cols, size_class(a.shape[0]),
        layout(a), layout(b), layout(scale_a), layout(scale_b), layout(bias),
    )


def fake(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: str = "bfloat16",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=OUT_DTYPES[out_dtype])


# Closeness against the accumulation's magnitude, justified in specs/_tolerance.py.
TOLERANCE = GEMM_OUTPUT


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Elementwise within TOLERANCE[out dtype], the absolute part scaled by sum_k |a||b|."""
    assert_same_kind(actual, expected, NAME)
    tolerance = TOLERANCE[expected.dtype]
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    deq_a, deq_b = dequantize_operands(cpu["a"], cpu["b"], cpu["scale_a"], cpu["scale_b"])
    mag = deq_a.abs().double() @ deq_b.abs().double().T
    if cpu["bias"] is not None:
        mag = mag + cpu["bias"].abs().double()
    assert_close_to_magnitude(actual, expected, mag, tolerance, NAME, "sum_k |a||b| + |bias|")


def cost(kwargs: Mapping[str, Any]) -> Cost:
    a, b, bias = kwargs["a"], kwargs["b"], kwargs["bias"]
    rows, cols = a.shape
    channels = b.shape[0]
    out_size = torch.empty((), dtype=OUT_DTYPES[kwargs["out_dtype"]]).element_size()
    bytes_moved = (
        a.numel() * a.element_size()
        + b.numel() * b.element_size()
        + (kwargs["scale_a"].numel() + kwargs["scale_b"].numel()) * 4
        + rows * channels * out_size
        + (bias.numel() * bias.element_size() if bias is not None else 0)
    )
    return Cost(flops=2 * rows * channels * cols, bytes=bytes_moved,
                matmul="fp8" if a.element_size() == 1 else "bf16")


# ---------------------------------------------------------------------------------------------
# Cases. The fp8 operands come from quantize_fp8's reference, as in a served model: activations
# drawn in bf16 (with outlier channels) and quantized dynamically, weights quantized offline.


def quantize_weight_blocks(
    w: torch.Tensor, ue8m0: bool = False, fp8_dtype: str = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` per 128 x 128 block (scale = block amax / fp8_max), DeepSeek-V3's
    weight format: each block becomes one row of quantize_fp8's per-token quantization."""
    channels, cols = w.shape
    n_blocks, k_blocks = -(-channels // BLOCK), -(-cols // BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, k_blocks * BLOCK - cols, 0, n_blocks * BLOCK - channels))
    blocks = padded.view(n_blocks, BLOCK, k_blocks, BLOCK).permute(0, 2, 1, 3)
    q, scale = quantize_fp8(
        blocks.reshape(n_blocks * k_blocks, BLOCK * BLOCK), "per_token", BLOCK, ue8m0, fp8_dtype
    )
    q = q.view(n_blocks, k_blocks, BLOCK, BLOCK).permute(0, 2, 1, 3)
    q = q.reshape(n_blocks * BLOCK, k_blocks * BLOCK)[:channels, :cols].contiguous()
    return q, scale.view(n_blocks, k_blocks)


def _maker(
    rows: int,
    channels: int,
    cols: int,
    layout: str,
    *,
    out_dtype: str = "bfloat16",
    with_bias: bool = False,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scalar_scales: bool = False,
    scale_a_layout: str = "k_major",
):
    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = torch.randn(rows, cols, generator=generator)
        if cols >= 16:
            x[:, torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)] *= 20.0
        x = x.to(torch.bfloat16)
        # Weight magnitudes of a trained layer (std ~ 1/sqrt(K)), with per-channel spread.
        w = torch.randn(channels, cols, generator=generator) / cols**0.5
        w *= torch.rand(channels, 1, generator=generator) + 0.5
        if layout == "block":
            a, scale_a = quantize_fp8(x, "per_group", BLOCK, ue8m0, fp8_dtype, scale_a_layout)
            b, scale_b = quantize_weight_blocks(w, ue8m0, fp8_dtype)
        else:
            granularity = "per_tensor" if layout == "tensor" else "per_token"
            a, scale_a = quantize_fp8(x, granularity, BLOCK, ue8m0, fp8_dtype)
            b, scale_b = quantize_fp8(w, granularity, BLOCK, ue8m0, fp8_dtype)
            if scalar_scales:
                scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
        bias = None
        if with_bias:
            bias = (torch.randn(channels, generator=generator) * 0.1).to(OUT_DTYPES[out_dtype])
        tensors = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias}
        moved = {k: v.to(device) if v is not None else None for k, v in tensors.items()}
        return {**moved, "out_dtype": out_dtype}

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    cases = [
        Case(f"deepseek_v3_m{m}_n{n}_k{k}", _maker(m, n, k, "block"),
             quick if m == 1 else model,
             f"DeepSeek-V3 block-scaled GEMM at {m} tokens: " + what)
        for n, k, what in ((7168, 2048, "expert down projection (I 2048 -> H 7168)"),
                           (2048, 7168, "H 7168 -> 2048 (an expert's gate or up half)"))
        for m in (1, 64, 1024)
    ]
    cases += [
        Case("deepseek_v3_m64_n7168_k2048_ue8m0", _maker(64, 7168, 2048, "block", ue8m0=True),
             model, "DeepSeek-V3 with UE8M0 (power-of-two) scales, as DeepGEMM uses on SM100"),
        Case("deepseek_v3_m1_n2048_k7168_mn_major", _maker(1, 2048, 7168, "block", scale_a_layout="mn_major"),
             quick, "DeepSeek-V3 H 7168 -> 2048 at one token, activation scales MN-major as quantize_fp8 writes "
             "them for a TMA consumer (no transpose before the GEMM)"),
        Case("llama3_8b_m1_per_token", _maker(1, 4096, 4096, "channel"), model,
             "Llama-3-8B o_proj (4096 x 4096), decode, per-token x per-channel scales"),
        Case("llama3_8b_m1024_per_token", _maker(1024, 4096, 4096, "channel"), model,
             "Llama-3-8B o_proj at a 1024-token prefill, per-token x per-channel"),
        Case("llama3_8b_m128_per_tensor", _maker(128, 4096, 4096, "tensor"), model,
             "Llama-3-8B o_proj with per-tensor scales (FP8 per-tensor checkpoints)"),
        Case("small_tensor", _maker(7, 24, 40, "tensor"), random, "per-tensor scales, bf16 out"),
        Case("small_tensor_scalar_fp32_bias",
             _maker(5, 16, 64, "tensor", out_dtype="float32", with_bias=True, scalar_scales=True),
             random, "0-d scale tensors (shape []), fp32 output and bias"),
        Case("small_channel_fp16_bias",
             _maker(6, 40, 96, "channel", out_dtype="float16", with_bias=True),
             random, "per-token x per-channel, fp16 output and bias"),
        Case("small_block", _maker(9, 256, 384, "block"), random, "2 x 3 blocks, bf16 out"),
        Case("small_block_mn_major", _maker(9, 256, 384, "block", scale_a_layout="mn_major"), random,
             "block scales with scale_a MN-major (column stride 12)"),
        Case("small_block_bias_fp32",
             _maker(4, 128, 256, "block", out_dtype="float32", with_bias=True), random,
             "block scales with an fp32 bias and output"),
        Case("small_block_fnuz", _maker(5, 256, 256, "block", fp8_dtype="e4m3fnuz"), random,
             "e4m3fnuz operands (max 240), as on gfx942"),
        Case("small_channel_fnuz_ue8m0",
             _maker(3, 32, 64, "channel", ue8m0=True, fp8_dtype="e4m3fnuz"), random,
             "e4m3fnuz with power-of-two per-token and per-channel scales"),
        Case("empty_block", _maker(0, 256, 512, "block"), edge,
             "M = 0: an empty batch gives a [0, N] output"),
        Case("empty_tensor", _maker(0, 64, 64, "tensor", with_bias=True), edge,
             "M = 0 with per-tensor scales and a bias"),
        Case("one_token_block", _maker(1, 256, 256, "block"), edge, "M = 1: one decode token"),
        Case("k_not_multiple_of_128_block", _maker(6, 256, 200, "block"), edge,
             "K = 200: the last K group/block has 72 elements"),
        Case("n_not_multiple_of_128_block", _maker(6, 200, 256, "block", with_bias=True), edge,
             "N = 200: the last row of weight blocks has 72 channels"),
        Case("both_not_multiple_of_128_block", _maker(3, 130, 129, "block"), edge,
             "N = 130, K = 129: one element past a block boundary in each"),
        Case("n1_k_below_128_block", _maker(4, 1, 100, "block"), edge,
             "N = 1, K = 100: block and channel scale shapes coincide (same math)"),
        Case("n_not_multiple_of_128_channel", _maker(2, 100, 48, "channel", out_dtype="float32"),
             edge, "per-channel with N and K below one block"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn GEMMs: M 0-40, N and K from 16 to 400 (ragged against the 128 blocks), every scale
    layout, every output dtype, bias, ue8m0 scales, both e4m3 flavours."""
    rows = draw(st.integers(0, 40))
    channels = draw(st.sampled_from([16, 40, 128, 200, 256, 400]))
    cols = draw(st.sampled_from([16, 64, 128, 200, 256, 384]))
    layout = draw(st.sampled_from(LAYOUTS))
    out_dtype = draw(st.sampled_from(sorted(OUT_DTYPES)))
    bias = draw(st.booleans())
    ue8m0 = draw(st.booleans())
    flavour = draw(st.sampled_from(["e4m3fn", "e4m3fnuz"]))
    scalar = layout == "tensor" and draw(st.booleans())
    return drawn(f"{rows} x {channels} x {cols}, {layout} scales{' (0-d)' if scalar else ''}, {out_dtype} out, "
                 f"{flavour}{', ue8m0' if ue8m0 else ''}{', bias' if bias else ''}",
                 _maker(rows, channels, cols, layout, out_dtype=out_dtype, with_bias=bias, ue8m0=ue8m0,
                        fp8_dtype=flavour, scalar_scales=scalar))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=scaled_mm,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
