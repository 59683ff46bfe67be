"""quantize_fp8: dynamic FP8 (e4m3) quantization per tensor, per token or per 1xG group; the spec,
its reference and its cases. The codes and scales it returns are the inputs of ``scaled_mm``, the
scales in the layout the caller's GEMM reads (K-major, or MN-major for TMA)."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._arith import ieee_div
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_choice, check_int, check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "quantize_fp8"]

NAME = "quantize_fp8"
GRANULARITIES = ("per_tensor", "per_token", "per_group")
# The API names the format with a string (a torch.dtype is not a custom-op argument type).
FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Largest finite value of each format: 448 (e4m3fn, OCP) and 240 (e4m3fnuz, AMD gfx942).
FP8_MAX = {name: torch.finfo(dtype).max for name, dtype in FP8_DTYPES.items()}
# per_group floors the group's amax (ops.md; DeepGEMM and SGLang use 1e-4): a near-zero group
# then gets a moderate scale instead of one that blows its noise up to full fp8 range.
GROUP_AMAX_FLOOR = 1e-4
# per_tensor and per_token floor the *scale* at the smallest normal fp32 (2^-126). This reaches
# only amax < fp8_max * 2^-126 (~5e-36; all-zero input included), so it leaves ops.md's
# "scale = amax / fp8_max" intact for every real input while keeping the scale a normal,
# non-zero number: no 0/0 for an all-zero row, and kernels that flush subnormals still agree.
SCALE_FLOOR = torch.finfo(torch.float32).tiny
# Where a [M, G] scale's elements lie: "k_major" (row after row: contiguous) or "mn_major" (column after
# column, each column of M scales padded to a multiple of TMA_ALIGN: the layout that Hopper's block-scaled
# GEMMs load by TMA, DeepGEMM's "MN-major TMA-aligned" one), so no transpose runs between the two ops.
SCALE_LAYOUTS = ("k_major", "mn_major")
TMA_ALIGN = 4  # fp32 scales per 16 bytes: TMA's alignment of a column's start


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 e4m3 with dynamically computed fp32 scales: ``x ~ q * scale``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, any strides; ``M >= 0``, ``K >= 1``. Must be finite
            (a NaN or Inf makes its scale, and so its codes, unspecified).
        granularity: which elements share a scale.
            ``"per_tensor"``: scale ``[1]`` = max(amax(x) / fp8_max, 2^-126);
            ``"per_token"``: scale ``[M, 1]`` = max(amax(row) / fp8_max, 2^-126);
            ``"per_group"``: scale ``[M, ceil(K / group_size)]`` over 1 x ``group_size`` groups
            along K (the last group is shorter when ``K % group_size != 0``) =
            max(amax(group), 1e-4) / fp8_max. An empty input (M = 0) has amax 0.
        group_size: elements per group for ``"per_group"`` (128 for DeepSeek-V3); ignored
            otherwise but still validated.
        ue8m0: round every scale *up* to the next power of two (exact: the smallest 2^e >= s),
            as UE8M0 scale formats need; codes are then computed with the rounded scale.
        fp8_dtype: ``"e4m3fn"`` (fp8_max 448) or ``"e4m3fnuz"`` (fp8_max 240).
        scale_layout: the strides of a ``[M, G]`` scale (per_group; per_token's ``[M, 1]`` is the same
            either way): ``"k_major"`` contiguous, ``"mn_major"`` ``(1, round_up(max(M, 1), 4))``,
            each column of M scales 16-byte aligned (what DeepGEMM's and CUTLASS's Hopper block
            GEMMs load by TMA). The values do not depend on it.

    Every step is fp32 and correctly rounded: ``scale = amax / fp8_max`` (an IEEE division, not a
    multiply by 1/fp8_max), ``q = fp8(clamp(x / scale, -fp8_max, fp8_max))`` with an IEEE division
    (not ``x * (1 / scale)``) and a round-to-nearest-even cast; -0.0 keeps its sign where the format
    has one (e4m3fn code 0x80). The clamp only guards against rounding: ``x / scale`` is within an
    ulp of ``fp8_max`` at most.

    Returns:
        ``q [M, K]`` in the fp8 dtype and ``scale`` fp32 in the shape above.
    """
    fp8 = FP8_DTYPES[fp8_dtype]
    fp8_max = FP8_MAX[fp8_dtype]
    values = x.float().contiguous()  # q contiguous whatever x's strides, as fake says
    rows, cols = values.shape
    magnitude = values.abs()
    if granularity == "per_group":
        groups = -(-cols // group_size)
        padded = torch.nn.functional.pad(magnitude, (0, groups * group_size - cols))  # zeros
        amax = padded.view(rows, groups, group_size).amax(dim=-1)
    elif granularity == "per_token":
        amax = magnitude.amax(dim=1, keepdim=True)
    else:
        amax = (magnitude.amax() if magnitude.numel() else magnitude.new_zeros(())).reshape(1)
    scale = scale_from_amax(amax, granularity, ue8m0, fp8_dtype)
    if granularity == "per_group":
        divisor = scale.repeat_interleave(group_size, dim=1)[:, :cols]
    else:
        divisor = scale
    q = (values / divisor).clamp(-fp8_max, fp8_max).to(fp8)
    return q, in_scale_layout(scale, scale_layout)


def _scale_strides(shape: tuple[int, ...], scale_layout: str) -> tuple[int, ...]:
    """The strides of a scale of ``shape`` in ``scale_layout`` (SCALE_LAYOUTS)."""
    if scale_layout == "mn_major" and len(shape) == 2:
        return (1, -(-max(shape[0], 1) // TMA_ALIGN) * TMA_ALIGN)
    strides, step = [], 1  # contiguous, as torch.empty makes them
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def empty_scale(shape: tuple[int, ...], scale_layout: str, device: torch.device) -> torch.Tensor:
    """An uninitialized fp32 scale of ``shape`` with ``scale_layout``'s strides."""
    return torch.empty_strided(shape, _scale_strides(shape, scale_layout), dtype=torch.float32, device=device)


def in_scale_layout(scale: torch.Tensor, scale_layout: str) -> torch.Tensor:
    """``scale`` itself when its strides are ``scale_layout``'s, else a copy that has them."""
    shape = tuple(scale.shape)
    if _strides_that_matter(shape, _scale_strides(shape, scale_layout)) == _strides_that_matter(
            shape, scale.stride()):
        return scale
    return empty_scale(shape, scale_layout, scale.device).copy_(scale)


def _strides_that_matter(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of the dims longer than 1 (a dim of length 1 is never stepped along)."""
    return tuple(stride for stride, size in zip(strides, shape) if size > 1)


def scale_from_amax(amax: torch.Tensor, granularity: str, ue8m0: bool, fp8_dtype: str) -> torch.Tensor:
    """The spec's scales from fp32 maxima (any shape): max(amax, 1e-4) / fp8_max for groups, else
    max(amax / fp8_max, 2^-126), IEEE divisions; ue8m0 rounds each up to a power of two."""
    fp8_max = FP8_MAX[fp8_dtype]
    if granularity == "per_group":
        scale = ieee_div(amax.clamp_min(GROUP_AMAX_FLOOR), fp8_max)
    else:
        scale = ieee_div(amax, fp8_max).clamp_min(SCALE_FLOOR)
    return round_up_to_power_of_two(scale) if ue8m0 else scale


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive normal fp32 ``scale``, exactly.

    Done on the bits (a mantissa that is not zero carries into the exponent) because
    ``2 ** ceil(log2(s))`` in fp32 rounds *down* when ``s`` is within an ulp or two of a power
    of two above it: ``log2(2^100 * (1 + 2^-23))`` rounds to exactly 100.
    """
    bits = scale.contiguous().view(torch.int32)
    rounded = (bits + 0x007FFFFF) & -0x00800000  # -0x00800000 == 0xFF800000 as int32
    return rounded.view(torch.float32)


class Key(NamedTuple):
    """quantize_fp8's dispatch key: what an implementation may decide on (OpSpec.key). K is the
    layer's; M (rows) changes per batch and is a class (``size_class``)."""

    device: torch.device
    x_dtype: torch.dtype
    granularity: str
    group_size: Optional[int]  # None unless per_group: the other granularities ignore it
    ue8m0: bool
    fp8_dtype: str
    scale_layout: str
    k: int
    m_class: int
    x_layout: Layout


def validate(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "x", x, dtypes=INPUT_DTYPES, rank=2)
    cols = x.shape[1]
    if cols < 1:
        raise InvalidArgumentError(
            NAME, "x", "K = x.shape[1] >= 1", f"shape {tuple(x.shape)}",
            hint="a zero-width row has no scale to compute",
        )
    check_choice(NAME, "granularity", granularity, GRANULARITIES)
    check_int(NAME, "group_size", group_size, low=1)
    if type(ue8m0) is not bool:
        raise InvalidArgumentError(NAME, "ue8m0", "a bool", type(ue8m0).__name__)
    check_choice(NAME, "fp8_dtype", fp8_dtype, FP8_DTYPES)
    check_choice(NAME, "scale_layout", scale_layout, SCALE_LAYOUTS)
    return Key(
        x.device, x.dtype, granularity, group_size if granularity == "per_group" else None, ue8m0,
        fp8_dtype, scale_layout, cols, size_class(x.shape[0]), layout(x),
    )


def fake(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if granularity == "per_group":
        scale_shape = (rows, (cols + group_size - 1) // group_size)
    elif granularity == "per_token":
        scale_shape = (rows, 1)
    else:
        scale_shape = (1,)
    return (
        x.new_empty((rows, cols), dtype=FP8_DTYPES[fp8_dtype]),
        empty_scale(scale_shape, scale_layout, x.device),
    )


# A quantizer is deterministic: every step is a correctly rounded fp32 operation or an exact
# comparison, so any conforming implementation produces the same bits. Codes and scales are
# compared exactly (check_close); the table records that for every input dtype.
TOLERANCE = {dtype: Tolerance(atol=0.0, rtol=0.0) for dtype in INPUT_DTYPES}


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise with the count and the first differing coordinate when the bits differ."""
    raw = torch.uint8 if got.element_size() == 1 else torch.int32
    got_bits, want_bits = got.detach().cpu().view(raw), want.detach().cpu().view(raw)
    differ = got_bits != want_bits
    if not bool(differ.any()):
        return
    first = tuple(int(i) for i in differ.nonzero()[0])
    mask = 0xFF if raw is torch.uint8 else 0xFFFFFFFF
    raise AssertionError(
        f"{NAME} {what}: {int(differ.sum())} of {differ.numel()} elements differ (bit-exact "
        f"required); first at {first}: got 0x{int(got_bits[first]) & mask:x} "
        f"({got.detach().cpu()[first].float().item():.9g}), expected "
        f"0x{int(want_bits[first]) & mask:x} ({want.detach().cpu()[first].float().item():.9g})"
    )


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Codes and scales must be bit-identical (codes compared as bytes, scales as int32 bits), and laid
    out as the spec's (the strides of dims longer than 1: a consumer, or a compiled graph, reads them)."""
    for got, want, what in zip(actual, expected, ("q", "scale")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
        if _strides_that_matter(got.shape, got.stride()) != _strides_that_matter(want.shape, want.stride()):
            raise AssertionError(f"{NAME} {what}: got strides {got.stride()}, expected {want.stride()} "
                                 f"(scale_layout {kwargs.get('scale_layout', 'k_major')!r})")
        _first_mismatch(got, want, what)


def cost(kwargs: Mapping[str, Any]) -> Cost:
    x = kwargs["x"]
    rows, cols = x.shape
    q, scale = fake(**kwargs)
    # Per element: |x|, a max, a divide and a clamp; the op is memory-bound by a wide margin.
    # A per-tensor scale needs a second pass in practice; the least work reads x once.
    return Cost(
        flops=4 * rows * cols,
        bytes=x.numel() * x.element_size() + rows * cols + scale.numel() * 4,
    )


# ---------------------------------------------------------------------------------------------
# Cases. Activations are drawn in the model's dtype (bf16) with a few outlier channels, as LLM
# hidden states have: they make per-token and per-group scales differ across a row.


def _activations(rows: int, cols: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=generator)
    if cols >= 16:
        outliers = torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)
        x[:, outliers] *= 20.0
    return x.to(dtype)


def _maker(
    rows: int,
    cols: int,
    granularity: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    fill: str = "random",
    scale_layout: str = "k_major",
):
    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = _activations(rows, cols, torch.float32, generator)
        if fill == "zero_rows":
            x[::2] = 0.0  # every other row, and so every group of it, is all zero
            if cols > group_size:
                x[1::2, :group_size] = 0.0  # and a zero first group in the other rows
        elif fill == "zeros":
            x = torch.zeros_like(x)
        elif fill == "extremes":
            # Each row's amax is the format's max, above it, or the input dtype's max; the amax
            # element must land on +-fp8_max exactly (code 0x7E/0xFE), never NaN.
            top = torch.finfo(dtype).max
            peaks = torch.tensor([FP8_MAX[fp8_dtype], -FP8_MAX[fp8_dtype], 1000.0, top, -top])
            x[:, 0] = peaks[torch.arange(rows) % peaks.numel()]
        elif fill == "tiny":
            # fp32 values far below any real activation: amax / fp8_max underflows past the
            # smallest normal fp32, so the scale floor decides; includes fp32 subnormals.
            x = x * 1e-38
        return {
            "x": x.to(dtype).to(device),
            "granularity": granularity,
            "group_size": group_size,
            "ue8m0": ue8m0,
            "fp8_dtype": fp8_dtype,
            "scale_layout": scale_layout,
        }

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    cases = [
        Case(f"deepseek_v3_m{m}{'_ue8m0' if ue8m0 else ''}",
             _maker(m, 7168, "per_group", ue8m0=ue8m0), quick if m <= 128 else model,
             f"DeepSeek-V3 hidden states (H 7168) at {m} tokens, 1x128 groups"
             + (", UE8M0 scales (DeepGEMM on SM100)" if ue8m0 else ""))
        for m in (1, 128, 1024)
        for ue8m0 in (False, True)
    ]
    cases += [
        Case("deepseek_v3_m1_mn_major", _maker(1, 7168, "per_group", scale_layout="mn_major"), quick,
             "DeepSeek-V3 decode, 1x128 groups, scales MN-major for the block GEMM's TMA (column stride 4)"),
        Case("deepseek_v3_m128_mn_major", _maker(128, 7168, "per_group", scale_layout="mn_major"), quick,
             "DeepSeek-V3 at 128 tokens, scales MN-major (column stride 128)"),
        Case("deepseek_v3_moe_down_m128", _maker(128, 2048, "per_group"), quick,
             "DeepSeek-V3 expert intermediate (I 2048) before the down projection"),
        Case("llama3_8b_m1_per_token", _maker(1, 4096, "per_token"), quick,
             "Llama-3-8B hidden 4096, one decode token, per-token scale"),
        Case("llama3_8b_m1024_per_token", _maker(1024, 4096, "per_token"), model,
             "Llama-3-8B hidden 4096, 1024-token prefill, per-token scale"),
        Case("llama3_8b_m1024_per_tensor", _maker(1024, 4096, "per_tensor"), model,
             "Llama-3-8B hidden 4096 with one dynamic per-tensor scale (FP8-dynamic checkpoints)"),
        Case("small_per_tensor", _maker(5, 96, "per_tensor", dtype=torch.float32), random,
             "fp32 input, K below one group"),
        Case("small_per_token_fp16", _maker(7, 130, "per_token", dtype=torch.float16), random,
             "fp16 input, odd M, K just over 128"),
        Case("small_per_group_ue8m0", _maker(6, 384, "per_group", ue8m0=True), random,
             "three full groups with power-of-two scales"),
        Case("small_fnuz_per_group", _maker(4, 256, "per_group", fp8_dtype="e4m3fnuz"), random,
             "e4m3fnuz (max 240, no negative zero), as on gfx942"),
        Case("small_fnuz_per_token_ue8m0",
             _maker(3, 64, "per_token", ue8m0=True, fp8_dtype="e4m3fnuz", dtype=torch.float16),
             random, "e4m3fnuz with rounded-up per-token scales"),
        Case("small_mn_major_ragged", _maker(5, 200, "per_group", scale_layout="mn_major"), random,
             "MN-major scales of 5 rows (column stride 8) over a full and a short group"),
        Case("small_per_token_mn_major", _maker(6, 96, "per_token", ue8m0=True, scale_layout="mn_major"),
             random, "per-token scales asked MN-major: one column, the same layout either way"),
        Case("small_group_64", _maker(4, 192, "per_group", group_size=64), random,
             "a group size other than 128"),
        Case("empty_per_group", _maker(0, 7168, "per_group"), edge,
             "M = 0: an empty batch returns [0, K] codes and [0, 56] scales"),
        Case("empty_mn_major", _maker(0, 256, "per_group", scale_layout="mn_major"), edge,
             "M = 0 with MN-major scales: a [0, 2] scale"),
        Case("empty_per_tensor", _maker(0, 256, "per_tensor"), edge,
             "M = 0 with one scale: amax of nothing is 0, so the scale is the floor 2^-126"),
        Case("one_token_per_group", _maker(1, 256, "per_group"), edge, "M = 1: a decode step"),
        Case("k_not_multiple_of_group", _maker(3, 200, "per_group"), edge,
             "K = 200: a full group of 128 and a short last group of 72"),
        Case("k_smaller_than_group", _maker(2, 5, "per_group", ue8m0=True), edge,
             "K = 5: one short group"),
        Case("zero_rows_per_group", _maker(4, 300, "per_group", fill="zero_rows"), edge,
             "all-zero rows and groups: scale = 1e-4 / 448, codes 0"),
        Case("zero_rows_per_token", _maker(4, 64, "per_token", fill="zero_rows"), edge,
             "all-zero rows: scale = the 2^-126 floor, codes 0"),
        Case("all_zero_per_tensor", _maker(3, 32, "per_tensor", fill="zeros"), edge,
             "an all-zero tensor: scale = the 2^-126 floor, codes 0"),
        Case("extremes_per_token", _maker(5, 64, "per_token", fill="extremes"), edge,
             "row maxima at +-448, 1000 and the bf16 max: the max element saturates to +-448"),
        Case("extremes_fnuz_fp16",
             _maker(5, 64, "per_token", fill="extremes", fp8_dtype="e4m3fnuz", dtype=torch.float16),
             edge, "e4m3fnuz (max 240) with fp16 inputs up to 65504"),
        Case("extremes_per_tensor_fp32",
             _maker(5, 64, "per_tensor", fill="extremes", dtype=torch.float32), edge,
             "one scale for the whole fp32 tensor whose amax is 3.4e38"),
        Case("tiny_fp32_per_token", _maker(3, 64, "per_token", fill="tiny", dtype=torch.float32),
             edge, "fp32 values ~1e-38 (subnormals included): the scale floor 2^-126 applies"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn quantizations: 0-40 rows of 1-300 columns, every granularity, groups of 64 or 128 with
    ragged tails, ue8m0 scales, both e4m3 flavours, zero rows and extremes, both scale layouts."""
    rows = draw(st.integers(0, 40))
    cols = draw(st.integers(1, 300))
    granularity = draw(st.sampled_from(GRANULARITIES))
    group = draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    ue8m0 = draw(st.booleans())
    flavour = draw(st.sampled_from(["e4m3fn", "e4m3fnuz"]))
    fill = draw(st.sampled_from(["random", "random", "zero_rows", "extremes"]))
    scale_layout = draw(st.sampled_from(SCALE_LAYOUTS))
    return drawn(f"{rows} x {cols}, {granularity}{f' (groups of {group})' if granularity == 'per_group' else ''}, "
                 f"{str(dtype)[6:]}, {flavour}{', ue8m0' if ue8m0 else ''}, {fill}, {scale_layout} scales",
                 _maker(rows, cols, granularity, dtype=dtype, group_size=group, ue8m0=ue8m0, fp8_dtype=flavour,
                        fill=fill, scale_layout=scale_layout))


SPEC = OpSpec(
    name=NAME,
    version=2,  # 2: scale_layout
    reference=quantize_fp8,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
