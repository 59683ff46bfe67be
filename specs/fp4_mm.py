"""fp4_mm: the FP4 GEMM with NVFP4 or MXFP4 weights, W4A16 (``a @ dequant(b).T``) or W4A4
(``dequant(a) @ dequant(b).T``); the spec, its reference and its cases."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close_to_magnitude, assert_same_kind
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, drawn, shapes_strategy
from kernelmux.specs._tolerance import GEMM_OUTPUT
from kernelmux.specs._validate import check_choice, check_tensor
from kernelmux.specs.quantize_mxfp4 import e8m0_to_float, quantize_mxfp4
from kernelmux.specs.quantize_nvfp4 import E2M1_VALUES, quantize_nvfp4
from kernelmux.specs.scaled_mm import OUT_DTYPES  # the GEMM specs share their output dtypes

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "decode_e2m1", "dequantize_fp4", "fp4_mm"]

NAME = "fp4_mm"
# The API names the output dtype with a string (a torch.dtype is not a custom-op argument type).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # W4A16; a uint8 `a` means W4A4
# Per format: the block along K and the dtype of its block scales.
BLOCKS = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPES = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}
FORMATS = tuple(BLOCKS)
# e2m1 codes 0..15: 0..7 from the table, 8..15 their negatives (8 is -0.0).
E2M1_TABLE = tuple(E2M1_VALUES) + tuple(-v for v in E2M1_VALUES)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[R, K/2]`` uint8, two e2m1 codes per byte (element ``2j`` in the low nibble) ->
    ``[R, K]`` fp32 values (exact)."""
    rows, half = packed.shape
    table = torch.tensor(E2M1_TABLE, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, 2 * half)
    return table[codes.long()]


def dequantize_fp4(
    q: torch.Tensor, scale: torch.Tensor, fmt: str, global_scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 ``[R, K]`` values of packed ``q [R, K/2]``: NVFP4 ``(e2m1 * sf) / gs`` (the product
    is exact, the division one fp32 rounding); MXFP4 ``e2m1 * 2^(code - 127)`` (exact; scale code
    0xFF is NaN and makes its whole block NaN)."""
    values = decode_e2m1(q)
    rows, cols = values.shape
    block = BLOCKS[fmt]
    blocks = values.view(rows, cols // block, block)
    if fmt == "nvfp4":
        gs = global_scale.float().reshape(())
        out = (blocks * scale.float().unsqueeze(-1)) / gs
    else:
        out = blocks * e8m0_to_float(scale).unsqueeze(-1)
    return out.view(rows, cols)


def fp4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str = "nvfp4",
    a_scale: Optional[torch.Tensor] = None,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
    out_dtype: str = "bfloat16",
) -> torch.Tensor:
    """FP4 matrix multiply: ``out = A @ B.T`` with ``B = dequant(b)`` and ``A = a`` (W4A16) or
    ``dequant(a)`` (W4A4). The mode follows ``a``'s dtype.

    Args:
        a: W4A16: ``[M, K]`` bfloat16 or float16 activations, with ``a_scale`` None.
            W4A4: ``[M, K/2]`` uint8, packed e2m1 codes in ``fmt`` (two per byte, element ``2j``
            in the low nibble), with ``a_scale``. Any strides; ``M >= 0``.
        b: ``[N, K/2]`` uint8 packed e2m1 codes (weights, one row per output channel); ``N >= 1``,
            ``K`` a positive multiple of the block (16 NVFP4, 32 MXFP4).
        b_scale: block scales of ``b`` in the canonical linear layout (not swizzled):
            NVFP4 ``[N, K/16]`` float8_e4m3fn; MXFP4 ``[N, K/32]`` uint8 e8m0 codes.
        fmt: ``"nvfp4"`` or ``"mxfp4"``; both operands of W4A4 use it.
        a_scale: W4A4 only: block scales of ``a``, ``[M, K/block]``, the same dtype as ``b_scale``.
        b_global_scale: NVFP4 only (required): fp32, one element (``[]`` or ``[1]``), the
            per-tensor ``gs`` that quantize_nvfp4 returns (``x ~ q * sf / gs``).
        a_global_scale: NVFP4 W4A4 only (required there): ``a``'s ``gs``, as ``b_global_scale``.
        out_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.

    Dequantization, per element in fp32: NVFP4 ``(e2m1(q) * sf) / gs``; MXFP4
    ``e2m1(q) * 2^(code - 127)`` (code 0xFF is NaN, so a NaN-scaled block makes the outputs it
    touches NaN). The product is computed in fp32 and rounded once to ``out_dtype``.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    deq_a, deq_b = dequantize_operands(a, b, b_scale, fmt, a_scale, b_global_scale, a_global_scale)
    return (deq_a @ deq_b.T).to(OUT_DTYPES[out_dtype])


def dequantize_operands(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str,
    a_scale: Optional[torch.Tensor],
    b_global_scale: Optional[torch.Tensor],
    a_global_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` and ``B`` of the product, in fp32."""
    deq_b = dequantize_fp4(b, b_scale, fmt, b_global_scale)
    if a.dtype == torch.uint8:
        deq_a = dequantize_fp4(a, a_scale, fmt, a_global_scale)
    else:
        deq_a = a.float()
    return deq_a, deq_b


def _check_global(name: str, value: Any, device: torch.device) -> None:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(NAME, name, "a torch.Tensor", type(value).__name__)
    if value.dtype != torch.float32:
        raise InvalidArgumentError(NAME, name, "dtype float32", value.dtype)
    if value.dim() > 1 or value.numel() != 1:
        raise InvalidArgumentError(NAME, name, "one element of shape [] or [1]",
                                   f"shape {tuple(value.shape)}")
    if value.device != device:
        raise InvalidArgumentError(
            NAME, name, f"a tensor on {device} (the device of the first input)", value.device
        )


def _check_scale(name: str, value: Any, fmt: str, shape: tuple, device: torch.device,
                 of: str) -> None:
    check_tensor(NAME, name, value, dtypes=(SCALE_DTYPES[fmt],), rank=2, device=device)
    if tuple(value.shape) != shape:
        raise InvalidArgumentError(
            NAME, name, f"shape {shape} ({of}, K/{BLOCKS[fmt]} for {fmt})",
            f"shape {tuple(value.shape)}",
        )


class Key(NamedTuple):
    """fp4_mm's dispatch key: what an implementation may decide on (OpSpec.key). N and K are the
    weight's, fixed per layer; M (tokens) changes per batch and is a class (``size_class``)."""

    device: torch.device
    mode: str  # "w4a16" (a bf16/fp16) or "w4a4" (a packed uint8)
    fmt: str
    a_dtype: torch.dtype
    out_dtype: str
    n: int
    k: int  # unpacked: 2 * b.shape[1]
    m_class: int
    a_layout: Layout
    b_layout: Layout
    b_scale_layout: Layout
    a_scale_layout: Optional[Layout]  # None: W4A16
    b_global_scale_layout: Optional[Layout]  # None: mxfp4
    a_global_scale_layout: Optional[Layout]  # None unless nvfp4 W4A4


def validate(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str = "nvfp4",
    a_scale: Optional[torch.Tensor] = None,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
    out_dtype: str = "bfloat16",
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "a", a, dtypes=ACTIVATION_DTYPES + (torch.uint8,), rank=2)
    device = a.device  # read once: building a torch.device costs ~0.3 us
    check_choice(NAME, "fmt", fmt, BLOCKS)
    block = BLOCKS[fmt]
    check_tensor(NAME, "b", b, dtypes=(torch.uint8,), rank=2, device=device)
    channels, half = b.shape
    cols = 2 * half
    if cols < block or cols % block:
        raise InvalidArgumentError(
            NAME, "b", f"shape (N, K/2) with K a positive multiple of {block} ({fmt} blocks)",
            f"shape {tuple(b.shape)}",
        )
    if channels < 1:
        raise InvalidArgumentError(NAME, "b", "N = b.shape[0] >= 1", f"shape {tuple(b.shape)}")
    w4a4 = a.dtype == torch.uint8
    rows = a.shape[0]
    if w4a4:
        if a.shape[1] != half:
            raise InvalidArgumentError(
                NAME, "a", f"shape (M, {half}) (packed W4A4: K/2 = b.shape[1])",
                f"shape {tuple(a.shape)}",
            )
    elif a.shape[1] != cols:
        raise InvalidArgumentError(
            NAME, "a", f"shape (M, {cols}) (W4A16: K = 2 * b.shape[1])", f"shape {tuple(a.shape)}"
        )
    _check_scale("b_scale", b_scale, fmt, (channels, cols // block), device, "N")
    if w4a4:
        if a_scale is None:
            raise InvalidArgumentError(NAME, "a_scale", "a tensor for packed (uint8) a", None,
                                       hint="W4A4 needs a's block scales")
        _check_scale("a_scale", a_scale, fmt, (rows, cols // block), device, "M")
    elif a_scale is not None:
        raise InvalidArgumentError(
            NAME, "a_scale", f"None when a is {a.dtype} (W4A16)", type(a_scale).__name__,
            hint="only packed uint8 activations have block scales",
        )
    if fmt == "nvfp4":
        if b_global_scale is None:
            raise InvalidArgumentError(NAME, "b_global_scale", "a tensor for nvfp4", None)
        _check_global("b_global_scale", b_global_scale, device)
    elif b_global_scale is not None:
        raise InvalidArgumentError(NAME, "b_global_scale", "None for mxfp4",
                                   type(b_global_scale).__name__)
    if fmt == "nvfp4" and w4a4:
        if a_global_scale is None:
            raise InvalidArgumentError(NAME, "a_global_scale", "a tensor for nvfp4 W4A4", None)
        _check_global("a_global_scale", a_global_scale, device)
    elif a_global_scale is not None:
        raise InvalidArgumentError(
            NAME, "a_global_scale", f"None for {fmt} {'W4A4' if w4a4 else 'W4A16'}",
            type(a_global_scale).__name__, hint="only NVFP4 packed activations have one",
        )
    check_choice(NAME, "out_dtype", out_dtype, OUT_DTYPES)
    return Key(
        device, "w4a4" if w4a4 else "w4a16", fmt, a.dtype, out_dtype, channels, cols,
        size_class(rows), layout(a), layout(b), layout(b_scale), layout(a_scale),
        layout(b_global_scale), layout(a_global_scale),
    )


def fake(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    fmt: str = "nvfp4",
    a_scale: Optional[torch.Tensor] = None,
    b_global_scale: Optional[torch.Tensor] = None,
    a_global_scale: Optional[torch.Tensor] = None,
    out_dtype: str = "bfloat16",
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=OUT_DTYPES[out_dtype])


# Closeness against the accumulation's magnitude, justified in specs/_tolerance.py.
TOLERANCE = GEMM_OUTPUT


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Elementwise within TOLERANCE[out dtype], the absolute part scaled by sum_k |A||B|; NaN
    and Inf must match exactly."""
    assert_same_kind(actual, expected, NAME)
    tolerance = TOLERANCE[expected.dtype]
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    deq_a, deq_b = dequantize_operands(
        cpu["a"], cpu["b"], cpu["b_scale"], cpu.get("fmt", "nvfp4"), cpu.get("a_scale"),
        cpu.get("b_global_scale"), cpu.get("a_global_scale"),
    )
    mag = deq_a.abs().double() @ deq_b.abs().double().T
    assert_close_to_magnitude(actual, expected, mag, tolerance, NAME, "sum_k |A||B|")


def cost(kwargs: Mapping[str, Any]) -> Cost:
    a, b = kwargs["a"], kwargs["b"]
    rows, channels, cols = a.shape[0], b.shape[0], 2 * b.shape[1]
    out_size = torch.empty((), dtype=OUT_DTYPES[kwargs.get("out_dtype", "bfloat16")]).element_size()
    tensors = [a, b] + [kwargs.get(n) for n in ("b_scale", "a_scale", "b_global_scale",
                                                  "a_global_scale")]
    bytes_moved = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    # W4A4 (packed activations) runs on FP4 tensor cores; W4A16 dequantizes into a bf16 GEMM.
    return Cost(flops=2 * rows * channels * cols, bytes=bytes_moved + rows * channels * out_size,
                matmul="fp4" if a.dtype == torch.uint8 else "bf16")


# ---------------------------------------------------------------------------------------------
# Cases. The packed operands come from quantize_nvfp4's and quantize_mxfp4's references, as in a
# served model: weights (randn / sqrt(K), per-channel spread) quantized offline, activations
# drawn in bf16 with outlier channels and (W4A4) quantized dynamically.


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(q, block_scale, global_scale or None)`` of ``x`` in ``fmt`` (the quantize ops' references)."""
    if fmt == "nvfp4":
        return quantize_nvfp4(x)
    q, scale = quantize_mxfp4(x)
    return q, scale, None


def _maker(
    rows: int,
    channels: int,
    cols: int,
    fmt: str,
    mode: str,
    *,
    act_dtype: torch.dtype = torch.bfloat16,
    out_dtype: str = "bfloat16",
    zero_blocks: bool = False,
):
    block = BLOCKS[fmt]

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = torch.randn(rows, cols, generator=generator)
        if cols >= 16:
            x[:, torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)] *= 20.0
        x = x.to(act_dtype)
        w = torch.randn(channels, cols, generator=generator) / cols**0.5
        w *= torch.rand(channels, 1, generator=generator) + 0.5
        if zero_blocks:
            w[::3] = 0.0  # whole zero rows
            w[1::3, :block] = 0.0  # a zero first block (NVFP4 sf 0; MXFP4 code 0)
            if channels > 1:
                w[1, block:2 * block] = -0.0  # negative zeros: codes 0
        b, b_scale, b_gs = quantize(w, fmt)
        kwargs: dict[str, Any] = {"a": x, "b": b, "b_scale": b_scale, "fmt": fmt, "a_scale": None,
                                  "b_global_scale": b_gs, "a_global_scale": None,
                                  "out_dtype": out_dtype}
        if mode == "w4a4":
            kwargs["a"], kwargs["a_scale"], kwargs["a_global_scale"] = quantize(x, fmt)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    # gpt-oss-120b MoE expert down projection [H 2880, I 2880] in MXFP4, W4A16 (Hopper's path:
    # dequant to bf16). Full size: the CPU reference and quantization take ~0.2 s.
    cases = [
        Case(f"gpt_oss_120b_mxfp4_w4a16_m{m}_n2880_k2880",
             _maker(m, 2880, 2880, "mxfp4", "w4a16"), quick,
             f"gpt-oss-120b expert down projection (I 2880 -> H 2880), decode M = {m}")
        for m in (1, 16)
    ]
    # DeepSeek-V3 NVFP4 checkpoints, W4A4 on SM100: K = H 7168 into an expert's gate/up
    # [2 * 2048, 7168]. The quick case slices N 4096 -> 512 for CPU time (~0.1 s; the full
    # shape takes ~1 s on a CPU and is tagged model only).
    cases += [
        Case("deepseek_v3_nvfp4_w4a4_m16_n512_k7168", _maker(16, 512, 7168, "nvfp4", "w4a4"),
             quick, "DeepSeek-V3 expert gate/up (K = H 7168) at 16 tokens, N sliced 4096 -> 512"),
        Case("deepseek_v3_nvfp4_w4a4_m16_n4096_k7168", _maker(16, 4096, 7168, "nvfp4", "w4a4"),
             model, "DeepSeek-V3 expert gate/up [4096, 7168] at 16 tokens, full size"),
        Case("deepseek_v3_nvfp4_w4a16_m16_n512_k7168", _maker(16, 512, 7168, "nvfp4", "w4a16"),
             quick, "the same weights as W4A16 (Hopper: no FP4 tensor cores), N sliced"),
        Case("small_nvfp4_w4a16", _maker(7, 24, 64, "nvfp4", "w4a16"), random,
             "NVFP4 weights, bf16 activations, four blocks"),
        Case("small_nvfp4_w4a16_fp16_fp32out",
             _maker(5, 40, 96, "nvfp4", "w4a16", act_dtype=torch.float16, out_dtype="float32"),
             random, "fp16 activations, fp32 output"),
        Case("small_nvfp4_w4a4", _maker(9, 32, 128, "nvfp4", "w4a4"), random,
             "NVFP4 both operands, two global scales"),
        Case("small_nvfp4_w4a4_fp16out", _maker(3, 17, 48, "nvfp4", "w4a4", out_dtype="float16"),
             random, "odd N, fp16 output"),
        Case("small_mxfp4_w4a16", _maker(6, 33, 96, "mxfp4", "w4a16"), random,
             "MXFP4 weights, bf16 activations, three blocks"),
        Case("small_mxfp4_w4a16_fp16", _maker(4, 16, 64, "mxfp4", "w4a16", act_dtype=torch.float16,
                                              out_dtype="float16"),
             random, "fp16 activations and output"),
        Case("small_mxfp4_w4a4", _maker(8, 20, 128, "mxfp4", "w4a4", out_dtype="float32"), random,
             "MXFP4 both operands, fp32 output"),
        Case("empty_nvfp4_w4a4", _maker(0, 64, 256, "nvfp4", "w4a4"), edge,
             "M = 0: an empty batch gives [0, N]"),
        Case("empty_mxfp4_w4a16", _maker(0, 64, 256, "mxfp4", "w4a16"), edge,
             "M = 0 in W4A16"),
        Case("one_token_nvfp4_w4a16", _maker(1, 48, 256, "nvfp4", "w4a16"), edge, "M = 1"),
        Case("one_token_mxfp4_w4a4", _maker(1, 48, 256, "mxfp4", "w4a4"), edge, "M = 1, W4A4"),
        Case("zero_blocks_nvfp4", _maker(5, 12, 64, "nvfp4", "w4a16", zero_blocks=True), edge,
             "zero weight rows and blocks (one of -0.0): sf 0, codes 0"),
        Case("zero_blocks_mxfp4", _maker(5, 12, 96, "mxfp4", "w4a4", zero_blocks=True), edge,
             "zero weight rows and blocks: e8m0 code 0 (2^-127), codes 0"),
        Case("one_block_nvfp4", _maker(3, 8, 16, "nvfp4", "w4a4"), edge, "K = 16: one NVFP4 block"),
        Case("one_block_mxfp4", _maker(3, 8, 32, "mxfp4", "w4a16"), edge, "K = 32: one MXFP4 block"),
        Case("one_channel_mxfp4", _maker(4, 1, 64, "mxfp4", "w4a16"), edge, "N = 1"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn calls: both formats, W4A16 and W4A4, 0-9 rows, 1-40 channels, 1-6 blocks of K, every
    activation and output dtype, zero weight blocks."""
    fmt = draw(st.sampled_from(sorted(BLOCKS)))
    mode = draw(st.sampled_from(["w4a16", "w4a4"]))
    rows, channels = draw(st.integers(0, 9)), draw(st.integers(1, 40))
    cols = BLOCKS[fmt] * draw(st.integers(1, 6))
    act_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    out_dtype = draw(st.sampled_from(["bfloat16", "float16", "float32"]))
    zero_blocks = draw(st.booleans())
    return drawn(f"{fmt} {mode}, M {rows}, N {channels}, K {cols}, {str(act_dtype)[6:]} a, {out_dtype} out, "
                 f"zero blocks {zero_blocks}",
                 _maker(rows, channels, cols, fmt, mode, act_dtype=act_dtype, out_dtype=out_dtype,
                        zero_blocks=zero_blocks))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=fp4_mm,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
