"""quantize_nvfp4: NVFP4 quantization (e2m1 codes in blocks of 16 along K, e4m3fn block scales,
one fp32 global scale); the spec, its reference and its cases. Also the e2m1 encoder, the nibble
packing and the block scales' layouts (linear, and the 128x4 swizzle that Blackwell's block-scaled
GEMMs read) shared by ``quantize_mxfp4`` and ``fp4_mm``."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._arith import ieee_div
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_choice, check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "E2M1_VALUES", "SCALE_LAYOUTS", "Key", "encode_e2m1", "in_scale_layout", "pack_nibbles",
           "quantize_nvfp4", "scale_shape", "swizzle_128x4"]

NAME = "quantize_nvfp4"
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# gs = 448 * 6 / amax(x): the largest block then gets sf = 448 and its largest element code +-6.
GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688, exact in fp32
# e2m1 codes 0..7; codes 8..15 are their negatives (sign in bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring codes k and k+1, and whether a tie exactly on the midpoint goes
# up: round-half-to-even goes to the even code (even mantissa bit), so up iff k is odd.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) of fp32 ``v``: round half to even, saturating at +-6; the sign bit
    is the sign bit of ``v`` (a negative value that rounds to zero gives 0x8, like PTX
    ``cvt.rn.satfinite.e2m1x2.f32``). NaN gives a zero magnitude (callers mask such blocks)."""
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` uint8 codes (K even) -> ``[M, K/2]`` bytes, element 2j in the LOW nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


# Block scale layouts: "linear" [M, K/block] (canonical), "swizzled_128x4" (below).
SCALE_LAYOUTS = ("linear", "swizzled_128x4")
# The 128x4 swizzle (what FlashInfer's quantizer writes, get_sf_out_offset_128x4 in quantization_utils.cuh, and its
# mm_fp4 reads): rows padded to 128 and scale columns to 4 with zeros; each 128 x 4 tile is 512 contiguous bytes,
# 32 rows of 16 bytes, the 16 being 4 row groups (r % 128 // 32) x the tile's 4 columns.
SWIZZLE_ROWS, SWIZZLE_COLS, SWIZZLE_ROW_GROUPS = 128, 4, 4


def scale_shape(rows: int, blocks: int, scale_layout: str) -> tuple[int, int]:
    """The shape of ``rows x blocks`` block scales in ``scale_layout``."""
    if scale_layout == "swizzled_128x4":
        return -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-blocks // SWIZZLE_COLS) * SWIZZLE_COLS
    return rows, blocks


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Linear block scales ``[R, C]`` -> the 128x4 swizzled layout, ``[round_up(R, 128), round_up(C, 4)]``
    contiguous, zero-padded (scale 0: finite in e4m3 and e8m0). Element (r, c) lands at byte
    ``(r // 128, c // 4, r % 32, r % 128 // 32, c % 4)`` of a ``[R'/128, C'/4, 32, 4, 4]`` array. Bytes in,
    bytes out: the dtype is kept (e4m3fn or e8m0 uint8)."""
    rows, cols = scale.shape
    padded_rows, padded_cols = scale_shape(rows, cols, "swizzled_128x4")
    padded = torch.zeros((padded_rows, padded_cols), dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    # [row tile, row group (r % 128 // 32), row in group (r % 32), column tile, column in tile]
    tiles = padded.view(padded_rows // SWIZZLE_ROWS, SWIZZLE_ROW_GROUPS, SWIZZLE_ROWS // SWIZZLE_ROW_GROUPS,
                        padded_cols // SWIZZLE_COLS, SWIZZLE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).contiguous().view(padded_rows, padded_cols).view(scale.dtype)


def in_scale_layout(scale: torch.Tensor, scale_layout: str) -> torch.Tensor:
    """Linear block scales in ``scale_layout``: themselves, or swizzled."""
    return swizzle_128x4(scale) if scale_layout == "swizzled_128x4" else scale


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4: ``x ~ e2m1(q) * block_scale / global_scale``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, any strides; ``M >= 0``; ``K`` a positive multiple of 16
            (a ragged K is rejected: pad with zeros). Must be finite, and ``amax(x)`` must be 0 or
            at least 2^-64 (a smaller non-zero amax overflows ``gs / sf``; results unspecified).
        global_scale: None (dynamic, the default): ``gs = 2688 / amax(x)`` (fp32 IEEE division,
            448 * 6 = 2688), and ``gs = 1`` when ``amax(x) = 0`` (also for M = 0). Or a
            calibrated fp32 tensor of one element (``[]`` or ``[1]``), positive and finite, used
            as ``gs`` (the static activation scale of NVFP4 checkpoints: ``input_global_scale``
            = 2688 / calibrated amax).
        scale_layout: ``"linear"`` (the default, canonical) or ``"swizzled_128x4"``, the layout
            Blackwell's block-scaled GEMMs read (FlashInfer's ``mm_fp4`` among them): rows
            padded to 128 and scale columns to 4 with zero scales, each 128 x 4 tile 512 bytes,
            element (r, c) at byte ``(r // 128, c // 4, r % 32, r % 128 // 32, c % 4)`` of a
            ``[M'/128, C'/4, 32, 4, 4]`` array (``swizzle_128x4``).

    Per block of 16 along K, all in fp32 and correctly rounded, in this order:
    ``sf = e4m3fn(min(gs * amax_block / 6, 448))`` (``(gs * amax_block) / 6``: a product then an
    IEEE division; the cast rounds to nearest even, subnormals included; the min only matters for
    a passed-in ``gs`` larger than 2688 / amax(x), and for the last-ulp overshoot of the dynamic
    one); ``r = gs / sf``; ``q = e2m1(x * r)`` rounded half to even and saturated at +-6, the sign
    bit from ``x * r`` (``-0.0`` and small negatives give code 0x8). A block whose ``sf`` is 0
    gets codes 0 (all of them, whatever the signs).

    Returns:
        ``q [M, K/2]`` uint8, two codes per byte, element ``2j`` in the low nibble;
        ``block_scale [M, K/16]`` float8_e4m3fn in the linear layout, or
        ``[round_up(M, 128), round_up(K/16, 4)]`` swizzled (contiguous either way);
        ``global_scale []`` fp32: the ``gs`` used (a fresh tensor, also when passed in).
    """
    values = x.float()
    rows, cols = values.shape
    if global_scale is None:
        amax = values.abs().amax() if values.numel() else values.new_zeros(())
        # A tensor numerator: ``float / tensor`` is reciprocal-then-multiply in torch (2 roundings).
        numerator = torch.full_like(amax, GLOBAL_NUMERATOR)
        gs = torch.where(amax > 0, numerator / amax, torch.ones_like(amax))
    else:
        gs = global_scale.float().reshape(()).clone()
    blocks = values.view(rows, cols // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    sf = ieee_div(gs * block_amax, E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    sf_value = sf.float()
    ratio = gs / sf_value  # inf where sf = 0; those blocks are masked below
    codes = encode_e2m1(blocks * ratio.unsqueeze(-1))
    codes = torch.where((sf_value == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    return pack_nibbles(codes.view(rows, cols)), in_scale_layout(sf, scale_layout), gs


class Key(NamedTuple):
    """quantize_nvfp4's dispatch key: what an implementation may decide on (OpSpec.key). K is
    the layer's; M (rows) changes per batch and is a class (``size_class``)."""

    device: torch.device
    x_dtype: torch.dtype
    k: int
    m_class: int
    x_layout: Layout
    global_scale_layout: Optional[Layout]  # None: the global scale is computed (dynamic)
    scale_layout: str


def validate(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "x", x, dtypes=INPUT_DTYPES, rank=2)
    cols = x.shape[1]
    if cols < BLOCK or cols % BLOCK:
        raise InvalidArgumentError(
            NAME, "x", f"K = x.shape[1] a positive multiple of {BLOCK}", f"shape {tuple(x.shape)}",
            hint="NVFP4 packs whole blocks of 16; pad K with zeros",
        )
    if global_scale is not None:
        if not isinstance(global_scale, torch.Tensor):
            raise InvalidArgumentError(NAME, "global_scale", "a torch.Tensor or None",
                                       type(global_scale).__name__)
        if global_scale.dtype != torch.float32:
            raise InvalidArgumentError(NAME, "global_scale", "dtype float32", global_scale.dtype)
        if global_scale.dim() > 1 or global_scale.numel() != 1:
            raise InvalidArgumentError(NAME, "global_scale", "one element of shape [] or [1]",
                                       f"shape {tuple(global_scale.shape)}")
        if global_scale.device != x.device:
            raise InvalidArgumentError(NAME, "global_scale", f"a tensor on {x.device} (x's device)",
                                       global_scale.device)
    check_choice(NAME, "scale_layout", scale_layout, SCALE_LAYOUTS)
    return Key(x.device, x.dtype, cols, size_class(x.shape[0]), layout(x), layout(global_scale), scale_layout)


def fake(
    x: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    return (
        x.new_empty((rows, cols // 2), dtype=torch.uint8),
        x.new_empty(scale_shape(rows, cols // BLOCK, scale_layout), dtype=torch.float8_e4m3fn),
        x.new_empty((), dtype=torch.float32),
    )


# Deterministic: every step is a correctly rounded fp32 operation, a round-to-nearest-even cast
# or an exact comparison, so every conforming implementation produces the same bits.
TOLERANCE = {dtype: Tolerance(atol=0.0, rtol=0.0) for dtype in INPUT_DTYPES}

_RAW = {1: torch.uint8, 4: torch.int32}


def first_mismatch(op: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise with the metadata, or the count and first differing coordinate of the raw bits."""
    if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
        raise AssertionError(
            f"{op} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
            f"{tuple(want.shape)} {want.dtype} on {want.device}"
        )
    raw = _RAW[got.element_size()]
    got_bits = got.detach().cpu().contiguous().view(raw)
    want_bits = want.detach().cpu().contiguous().view(raw)
    differ = got_bits != want_bits
    if not bool(differ.any()):
        return
    first = tuple(int(i) for i in differ.nonzero()[0])
    mask = 0xFF if raw is torch.uint8 else 0xFFFFFFFF
    raise AssertionError(
        f"{op} {what}: {int(differ.sum())} of {differ.numel()} elements differ (bit-exact "
        f"required); first at {first}: got 0x{int(got_bits[first]) & mask:x}, expected "
        f"0x{int(want_bits[first]) & mask:x}"
    )


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Codes, block scales (bytes) and the global scale (fp32 bits) must be bit-identical."""
    for got, want, what in zip(actual, expected, ("q", "block_scale", "global_scale")):
        first_mismatch(NAME, got, want, what)


def cost(kwargs: Mapping[str, Any]) -> Cost:
    x = kwargs["x"]
    rows, cols = x.shape
    # Per element: |x|, a max, a multiply and the rounding; memory-bound. The dynamic global
    # scale needs a second pass over x in practice; the least work reads x once.
    passed = 4 if kwargs.get("global_scale") is not None else 0
    scale_rows, scale_cols = scale_shape(rows, cols // BLOCK, kwargs.get("scale_layout", "linear"))
    return Cost(
        flops=4 * rows * cols,
        bytes=x.numel() * x.element_size() + rows * cols // 2 + scale_rows * scale_cols + 4 + passed,
    )


# ---------------------------------------------------------------------------------------------
# Cases: activations in bf16 with outlier channels (LLM hidden states); weights as randn / sqrt(K).


def _activations(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=generator)
    if cols >= 16:
        outliers = torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)
        x[:, outliers] *= 20.0
    return x


def _maker(rows: int, cols: int, *, dtype: torch.dtype = torch.bfloat16, fill: str = "random",
           static: Optional[float] = None, scale_layout: str = "linear"):
    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = _activations(rows, cols, generator)
        if fill == "weights":
            x = torch.randn(rows, cols, generator=generator) / cols**0.5
        elif fill == "zero_blocks":
            x[::2] = 0.0
            x[1::2, :BLOCK] = 0.0
            if rows > 1:
                x[1, BLOCK:2 * BLOCK] = -0.0  # a block of negative zeros: codes 0, not 0x8
        elif fill == "zeros":
            x = torch.zeros_like(x)
        elif fill == "outlier":
            # One huge element: blocks of small values get sf 0 or e4m3 subnormal scales.
            x = x * 1e-3
            x[0, 0] = 1e4
        elif fill == "extremes":
            top = torch.finfo(dtype).max
            peaks = torch.tensor([top, -top, 6.0, -1.0, 1000.0])
            x[:, 0] = peaks[torch.arange(rows) % peaks.numel()]
        elif fill == "tiny":
            x = x * 1e-18  # amax ~1e-16 >= 2^-64: gs ~ 2.7e19, sf still normal e4m3
        kwargs = {"x": x.to(dtype).to(device)}
        kwargs["global_scale"] = (
            None if static is None else torch.tensor(static, dtype=torch.float32, device=device))
        kwargs["scale_layout"] = scale_layout
        return kwargs

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    cases = [
        Case(f"deepseek_v3_m{m}", _maker(m, 7168), quick if m <= 128 else model,
             f"DeepSeek-V3/R1 (NVFP4 checkpoints) hidden states H 7168 at {m} tokens")
        for m in (1, 128, 1024)
    ]
    cases += [
        Case("deepseek_v3_m128_static", _maker(128, 7168, static=2688.0 / 60.0), quick,
             "H 7168 with a calibrated input_global_scale (amax 60): outliers saturate at +-6"),
        Case("deepseek_v3_moe_down_m128", _maker(128, 2048), quick,
             "DeepSeek-V3 expert intermediate (I 2048) before the down projection"),
        Case("deepseek_v3_expert_weight_rows256", _maker(256, 7168, fill="weights"), model,
             "offline weight quantization of an expert gate/up projection [4096, 7168], 256 rows"),
        Case("deepseek_v3_m128_swizzled", _maker(128, 7168, scale_layout="swizzled_128x4"), quick,
             "H 7168 for a Blackwell W4A4 GEMM: block scales in the 128x4 swizzled layout"),
        Case("llama3_8b_m1", _maker(1, 4096), quick, "Llama-3-8B hidden 4096, one decode token"),
        Case("llama3_8b_m1024", _maker(1024, 4096), model, "Llama-3-8B hidden 4096, prefill"),
        Case("small_fp32", _maker(5, 96, dtype=torch.float32), random, "fp32, six blocks"),
        Case("small_fp16", _maker(7, 160, dtype=torch.float16), random, "fp16, odd M"),
        Case("small_static", _maker(4, 64, dtype=torch.float32, static=300.0), random,
             "a passed-in global scale"),
        Case("small_swizzled_ragged", _maker(130, 80, dtype=torch.float32, scale_layout="swizzled_128x4"), random,
             "swizzled scales of 130 rows x 5 blocks: a second row tile, rows and columns padded with zeros"),
        Case("empty", _maker(0, 7168), edge, "M = 0: gs = 1, empty codes and scales"),
        Case("one_block", _maker(1, 16), edge, "K = 16: one block"),
        Case("empty_swizzled", _maker(0, 64, scale_layout="swizzled_128x4"), edge,
             "M = 0 with swizzled scales: [0, 4], nothing padded"),
        Case("one_block_swizzled", _maker(1, 16, scale_layout="swizzled_128x4"), edge,
             "one scale, swizzled: a 128 x 4 tile of zeros but its first byte"),
        Case("zero_blocks", _maker(4, 64, fill="zero_blocks"), edge,
             "all-zero rows and blocks (one of -0.0): sf 0, codes 0"),
        Case("all_zero", _maker(3, 32, fill="zeros"), edge, "amax(x) = 0: gs = 1, sf 0, codes 0"),
        Case("outlier_small_blocks", _maker(4, 256, dtype=torch.float32, fill="outlier"), edge,
             "one 1e4 element: other blocks get sf 0 or subnormal e4m3 scales"),
        Case("extremes_bf16", _maker(5, 64, fill="extremes"), edge,
             "row maxima up to the bf16 max: gs ~ 7.9e-36, the max element lands on +-6"),
        Case("extremes_fp16", _maker(5, 64, dtype=torch.float16, fill="extremes"), edge,
             "fp16 inputs up to 65504"),
        Case("saturating_static", _maker(3, 48, dtype=torch.float32, static=2688.0), edge,
             "gs 2688 against amax ~60: sf clamps at 448, elements beyond 6 * sf / gs saturate"),
        Case("tiny_fp32", _maker(3, 64, dtype=torch.float32, fill="tiny"), edge,
             "values ~1e-18: a huge but finite global scale"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn calls: 0-9 rows of 1-12 blocks, every input dtype, a dynamic or a static global scale, both
    scale layouts, and the edge fills (zero blocks, all zero, one outlier, each dtype's extremes, tiny values)."""
    fill = draw(st.sampled_from(["random", "weights", "zero_blocks", "zeros", "outlier", "extremes", "tiny"]))
    rows = draw(st.integers({"zero_blocks": 2, "outlier": 1}.get(fill, 0), 9))
    cols = BLOCK * draw(st.integers(2 if fill == "zero_blocks" else 1, 12))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    static = draw(st.sampled_from([None, 1.0, 300.0])) if fill in ("random", "weights") else None
    scale_layout = draw(st.sampled_from(SCALE_LAYOUTS))
    return drawn(f"M {rows}, K {cols}, {str(dtype)[6:]}, {fill}, global scale {static or 'dynamic'}, "
                 f"{scale_layout} scales",
                 _maker(rows, cols, dtype=dtype, fill=fill, static=static, scale_layout=scale_layout))


SPEC = OpSpec(
    name=NAME,
    version=2,  # 2: scale_layout
    reference=quantize_nvfp4,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
