"""quantize_mxfp4: MXFP4 quantization (OCP MX v1.0: e2m1 codes in blocks of 32 along K sharing
one e8m0 power-of-two scale); the spec, its reference and its cases."""

from typing import Any, Mapping, NamedTuple

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._arith import ieee_div
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_choice, check_tensor
from kernelmux.specs.quantize_nvfp4 import (SCALE_LAYOUTS, encode_e2m1, first_mismatch, in_scale_layout, pack_nibbles,
                                             scale_shape)

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "e8m0_to_float", "quantize_mxfp4"]

NAME = "quantize_mxfp4"
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 32
ROUNDINGS = ("floor", "ceil")
E8M0_BIAS = 127
E8M0_NAN = 0xFF
EXPONENT_MIN, EXPONENT_MAX = -127, 127
# e2m1's largest power of two is 4 = 2^2: OCP's floor rounding maps amax_block to [4, 8).
E2M1_EMAX = 2


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of e8m0 codes (uint8): 2^(code - 127), exactly (2^-127 is an fp32 subnormal);
    code 0xFF is NaN."""
    c = code.to(torch.int32)
    normal = torch.clamp(c, min=1) << 23  # 2^(c-127) for c >= 1: biased fp32 exponent c
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), normal)  # 2^-127: subnormal 0x00400000
    value = bits.view(torch.float32)
    return torch.where(c == E8M0_NAN, torch.full_like(value, float("nan")), value)


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP4: ``x ~ e2m1(q) * 2^(scale - 127)``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, any strides; ``M >= 0``; ``K`` a positive multiple of 32
            (a ragged K is rejected: pad with zeros). NaN and Inf are allowed (see below).
        rounding: how a block's power-of-two scale ``X = 2^e`` is chosen from its
            ``amax_block`` (fp32):
            ``"floor"`` (OCP MX v1.0): ``e = floor(log2(amax_block)) - 2``, exact (from the fp32
            exponent; subnormal amax included); then ``amax_block / X`` is in [4, 8) and
            elements above 6 * X saturate;
            ``"ceil"`` (NVIDIA tooling): ``e = ceil(log2(d))`` of ``d = amax_block / 6`` (an fp32
            IEEE division), exact on ``d``: the smallest ``X >= d``, so no element saturates.
            Either way ``e`` is clamped to [-127, 127] and the scale code is ``e + 127``.
        scale_layout: ``"linear"`` (the default, canonical) or ``"swizzled_128x4"``, the layout
            Blackwell's block-scaled GEMMs read, as quantize_nvfp4 defines it (rows padded to 128
            and scale columns to 4 with code 0).

    Elements: ``e2m1(x / X)`` (exact but for underflow of values that round to 0 anyway),
    rounded half to even and saturated at +-6, sign bit from ``x`` (a negative value that rounds
    to zero gives code 0x8). An all-zero block (``amax_block = 0``, -0.0 included) gets scale
    code 0 (2^-127) and codes 0. A block holding a NaN or an Inf gets scale code 0xFF (NaN) and
    codes 0.

    Returns:
        ``q [M, K/2]`` uint8, two codes per byte, element ``2j`` in the low nibble;
        ``scale [M, K/32]`` uint8 e8m0 codes in the linear layout, or
        ``[round_up(M, 128), round_up(K/32, 4)]`` swizzled (contiguous either way).
    """
    values = x.float()
    rows, cols = values.shape
    blocks = values.view(rows, cols // BLOCK, BLOCK)
    magnitude = blocks.abs()
    nonfinite = ~torch.isfinite(blocks).all(dim=-1)
    block_amax = torch.where(torch.isfinite(magnitude), magnitude, 0.0).amax(dim=-1)
    zero = block_amax == 0
    if rounding == "floor":
        _, exponent = torch.frexp(block_amax)  # amax = m * 2^exponent, m in [0.5, 1)
        e = exponent - 1 - E2M1_EMAX
    else:
        mantissa, exponent = torch.frexp(ieee_div(block_amax, 6.0))
        e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = e.clamp(EXPONENT_MIN, EXPONENT_MAX)
    code = (e + E8M0_BIAS).to(torch.uint8)
    code = torch.where(zero, torch.zeros_like(code), code)
    code = torch.where(nonfinite, torch.full_like(code, E8M0_NAN), code)
    divisor = e8m0_to_float((e + E8M0_BIAS).to(torch.uint8))
    codes = encode_e2m1(blocks / divisor.unsqueeze(-1))
    codes = torch.where((zero | nonfinite).unsqueeze(-1), torch.zeros_like(codes), codes)
    return pack_nibbles(codes.view(rows, cols)), in_scale_layout(code, scale_layout)


class Key(NamedTuple):
    """quantize_mxfp4's dispatch key: what an implementation may decide on (OpSpec.key). K is
    the layer's; M (rows) changes per batch and is a class (``size_class``)."""

    device: torch.device
    x_dtype: torch.dtype
    k: int
    rounding: str
    m_class: int
    x_layout: Layout
    scale_layout: str


def validate(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "x", x, dtypes=INPUT_DTYPES, rank=2)
    cols = x.shape[1]
    if cols < BLOCK or cols % BLOCK:
        raise InvalidArgumentError(
            NAME, "x", f"K = x.shape[1] a positive multiple of {BLOCK}", f"shape {tuple(x.shape)}",
            hint="MXFP4 packs whole blocks of 32; pad K with zeros",
        )
    check_choice(NAME, "rounding", rounding, ROUNDINGS)
    check_choice(NAME, "scale_layout", scale_layout, SCALE_LAYOUTS)
    return Key(x.device, x.dtype, cols, rounding, size_class(x.shape[0]), layout(x), scale_layout)


def fake(
    x: torch.Tensor,
    rounding: str = "floor",
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    return (
        x.new_empty((rows, cols // 2), dtype=torch.uint8),
        x.new_empty(scale_shape(rows, cols // BLOCK, scale_layout), dtype=torch.uint8),
    )


# Deterministic: exact exponent arithmetic, one correctly rounded division ("ceil") and exact
# comparisons; every conforming implementation produces the same bytes.
TOLERANCE = {dtype: Tolerance(atol=0.0, rtol=0.0) for dtype in INPUT_DTYPES}


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Codes and e8m0 scale codes must be byte-identical."""
    for got, want, what in zip(actual, expected, ("q", "scale")):
        first_mismatch(NAME, got, want, what)


def cost(kwargs: Mapping[str, Any]) -> Cost:
    x = kwargs["x"]
    rows, cols = x.shape
    scale_rows, scale_cols = scale_shape(rows, cols // BLOCK, kwargs.get("scale_layout", "linear"))
    return Cost(
        flops=4 * rows * cols,
        bytes=x.numel() * x.element_size() + rows * cols // 2 + scale_rows * scale_cols,
    )


# ---------------------------------------------------------------------------------------------
# Cases. gpt-oss-120b ships its MoE expert weights in MXFP4 (H 2880, I 2880): weights are
# randn / sqrt(K); activations bf16 with outlier channels.


def _maker(rows: int, cols: int, rounding: str = "floor", *, dtype: torch.dtype = torch.bfloat16,
           fill: str = "activations", scale_layout: str = "linear"):
    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = torch.randn(rows, cols, generator=generator)
        if fill == "weights":
            x = x / cols**0.5
        else:
            outliers = torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)
            x[:, outliers] *= 20.0
        if fill == "zero_blocks":
            x[::2] = 0.0
            x[1::2, :BLOCK] = 0.0
            if rows > 1:
                x[1, BLOCK:2 * BLOCK] = -0.0
        elif fill == "nonfinite":
            x[0, 3] = float("nan")
            x[1 % rows, BLOCK + 5] = float("inf")
            x[2 % rows, 2 * BLOCK] = float("-inf")
        elif fill == "saturating":
            # A block max of 7.5 * 2^k: floor gives X = 2^(k+1)... elements 6..8 X saturate.
            x[:, 0] = 7.5 * 2.0 ** torch.arange(rows, dtype=torch.float32).remainder(5)
            x[:, 1] = -x[:, 0] * 0.9
        elif fill == "tiny":
            x = x * 1e-39  # fp32 subnormals: the exponent clamp at -127 applies
        elif fill == "extremes":
            top = torch.finfo(dtype).max
            peaks = torch.tensor([top, -top, 6.0, 65504.0, 1e-3])
            x[:, 0] = peaks[torch.arange(rows) % peaks.numel()]
        kwargs = {"x": x.to(dtype).to(device), "rounding": rounding}
        kwargs["scale_layout"] = scale_layout
        return kwargs

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    cases = [
        Case(f"gpt_oss_120b_expert_w_rows{r}_{rnd}",
             _maker(r, 2880, rnd, fill="weights"), quick if r <= 64 else model,
             f"gpt-oss-120b MoE expert weight (H 2880 x I 2880), {r} rows, {rnd} scales")
        for r in (64, 2880)
        for rnd in ROUNDINGS
    ]
    cases += [
        Case(f"gpt_oss_120b_act_m{m}", _maker(m, 2880), quick if m <= 128 else model,
             f"gpt-oss-120b hidden states (H 2880) at {m} tokens (W4A4 MXFP4 on SM100)")
        for m in (1, 128, 1024)
    ]
    cases += [
        Case("deepseek_v3_m128_ceil", _maker(128, 7168, "ceil"), quick,
             "DeepSeek-V3 hidden states H 7168, ceil scales"),
        Case("gpt_oss_120b_act_m128_swizzled", _maker(128, 2880, scale_layout="swizzled_128x4"), quick,
             "gpt-oss-120b hidden states at 128 tokens for a Blackwell W4A4 GEMM: scales swizzled 128x4 "
             "(90 blocks padded to 92)"),
        Case("llama3_8b_m1024", _maker(1024, 4096), model, "Llama-3-8B hidden 4096, prefill"),
        Case("small_fp32", _maker(5, 96, dtype=torch.float32), random, "fp32, three blocks"),
        Case("small_fp16_ceil", _maker(7, 160, "ceil", dtype=torch.float16), random,
             "fp16, odd M, ceil"),
        Case("small_swizzled_ragged", _maker(131, 160, "ceil", dtype=torch.float32, scale_layout="swizzled_128x4"),
             random, "swizzled scales of 131 rows x 5 blocks: a second row tile, rows and columns padded"),
        Case("empty", _maker(0, 2880), edge, "M = 0: empty codes and scales"),
        Case("empty_swizzled", _maker(0, 2880, scale_layout="swizzled_128x4"), edge,
             "M = 0 with swizzled scales: [0, 92]"),
        Case("one_block", _maker(1, 32, "ceil"), edge, "K = 32: one block"),
        Case("zero_blocks", _maker(4, 128, fill="zero_blocks"), edge,
             "all-zero rows and blocks (one of -0.0): scale code 0, codes 0"),
        Case("nonfinite_blocks", _maker(3, 96, dtype=torch.float32, fill="nonfinite"), edge,
             "NaN, +Inf and -Inf in three blocks: scale 0xFF, codes 0; the others unaffected"),
        Case("nonfinite_blocks_ceil", _maker(3, 96, "ceil", fill="nonfinite"), edge,
             "the same in bf16 with ceil scales"),
        Case("saturating_floor", _maker(5, 64, dtype=torch.float32, fill="saturating"), edge,
             "block maxima 7.5 * 2^k: floor scales make elements beyond 6 X saturate"),
        Case("tiny_fp32_floor", _maker(3, 64, dtype=torch.float32, fill="tiny"), edge,
             "fp32 subnormals: the exponent clamps at -127"),
        Case("tiny_fp32_ceil", _maker(3, 64, "ceil", dtype=torch.float32, fill="tiny"), edge,
             "fp32 subnormals with ceil scales"),
        Case("extremes_bf16_ceil", _maker(5, 64, "ceil", fill="extremes"), edge,
             "block maxima up to the bf16 max (exponent 127 - 2 = 125)"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn calls: 0-9 rows of 1-8 blocks, every input dtype, floor and ceil rounding, both scale layouts, and
    the edge fills (zero blocks, NaN/Inf, saturating maxima, fp32 subnormals, each dtype's extremes)."""
    fill = draw(st.sampled_from(["activations", "weights", "zero_blocks", "nonfinite", "saturating", "tiny",
                                 "extremes"]))
    rows = draw(st.integers(3 if fill in ("zero_blocks", "nonfinite") else 0, 9))
    cols = BLOCK * draw(st.integers(3 if fill == "nonfinite" else 2 if fill == "zero_blocks" else 1, 8))
    dtype = torch.float32 if fill == "tiny" else draw(st.sampled_from([torch.bfloat16, torch.float16,
                                                                      torch.float32]))
    rounding = draw(st.sampled_from(["floor", "ceil"]))
    scale_layout = draw(st.sampled_from(SCALE_LAYOUTS))
    return drawn(f"M {rows}, K {cols}, {str(dtype)[6:]}, {rounding}, {fill}, {scale_layout} scales",
                 _maker(rows, cols, rounding, dtype=dtype, fill=fill, scale_layout=scale_layout))


SPEC = OpSpec(
    name=NAME,
    version=2,  # 2: scale_layout
    reference=quantize_mxfp4,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
