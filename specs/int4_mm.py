"""int4_mm: the int4-weight GEMM ``A @ dequant(b).T (+ bias)``, symmetric int4 weights scaled per group
along K or per channel, the activations quantized dynamically to int8 per row inside the op (W4A8, as
KleidiAI and torch's ``_dyn_quant_matmul_4bit`` compute it) or used as they are (W4A16); the spec."""

from typing import Any, Iterator, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close_to_magnitude, assert_same_kind
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, drawn, shapes_strategy
from kernelmux.specs._tolerance import GEMM_OUTPUT
from kernelmux.specs._validate import check_choice, check_int, check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Int8Rows", "Key", "dequantize_int4", "int4_mm", "pack_int4", "quantize_int4_weight",
           "quantize_int8_rows", "unpack_int4"]

NAME = "int4_mm"
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32 and bf16 are what torch's op takes (fp32 channelwise, bf16 groupwise); fp16 is what GPTQ/AWQ
# checkpoints store. The dtype is in the key, so an implementation declines what it would round.
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# "int8_dynamic": W4A8, each activation row quantized to int8 inside the op; "none": W4A16.
ACT_QUANTS = ("int8_dynamic", "none")
ZERO_CODE = 8  # a code holds value + 8: codes 0..15 are the values -8..7
INT8_MIN, INT8_MAX = -128, 127
# The reference's exact integer sums are computed a chunk of groups at a time: at most this many
# fp64 elements ([groups, M, N]) at once, 32 MiB.
_CHUNK_ELEMENTS = 1 << 22


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` integers in [-8, 7] (K even) -> ``[R, K/2]`` uint8 codes ``value + 8``, two per byte,
    element ``2j`` in the low nibble: ``codes[:, 1::2] << 4 | codes[:, ::2]`` (torch's layout)."""
    codes = (values.to(torch.int16) + ZERO_CODE).to(torch.uint8)
    return codes[:, 1::2] << 4 | codes[:, ::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, K/2]`` uint8 codes -> ``[R, K]`` int8 values in [-8, 7] (code - 8; element ``2j`` from
    the low nibble)."""
    rows, half = packed.shape
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, 2 * half)
    return (codes.to(torch.int16) - ZERO_CODE).to(torch.int8)


def dequantize_int4(b: torch.Tensor, b_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``[N, K]`` weights of packed ``b [N, K/2]``: value * the scale of its group (one fp32
    rounding of a 4-bit integer times the scale)."""
    values = unpack_int4(b).float()
    return values * b_scale.float().repeat_interleave(group_size, dim=1)


class Int8Rows(NamedTuple):
    """One activation row's int8 quantization: ``x ~ (q - zero_point) * recip``."""

    q: torch.Tensor  # [M, K] int8
    zero_point: torch.Tensor  # [M, 1] int32, in [-128, 127]
    scale: torch.Tensor  # [M, 1] fp32, the multiplier: 255 / (rmax - rmin), 1 for an all-zero row
    recip: torch.Tensor  # [M, 1] fp32, 1 / scale (the dequantization step)


def quantize_int8_rows(a: torch.Tensor) -> Int8Rows:
    """Asymmetric int8 quantization of each row of ``a [M, K]``, computed as KleidiAI's
    ``kai_run_lhs_quant_pack_qai8dxp_f32`` and torch's fallback (``ref_dyn_quant_matmul_4bit_*_kernel``
    in aten/src/ATen/native/cpu/int4mm_kernel.cpp) do, step for step in fp32 on ``a``'s values:

    - ``rmin = min(0, min(row))``, ``rmax = max(0, max(row))`` (the range always holds 0);
    - ``scale = 255 / (rmax - rmin)``, 1 when ``rmin == rmax``; ``recip = 1 / scale``;
    - the zero point nearest the range: ``zp = -128 - rmin * scale`` when ``(-128 + rmin * scale) +
      (127 + rmax * scale) > 0``, else ``127 - rmax * scale``; clamped to [-128, 127] and rounded
      half to even (``rintf``);
    - ``q = clamp(round(x * scale) + zp, -128, 127)``, the product rounded to fp32 first and then
      to an integer half away from zero (``roundf``: not torch.round's half to even).
    """
    x = a.float()
    rmin = x.amin(dim=1, keepdim=True).clamp(max=0.0)
    rmax = x.amax(dim=1, keepdim=True).clamp(min=0.0)
    # IEEE divisions of tensors: torch computes ``255.0 / t`` as 255 * (1 / t), two roundings.
    ones = torch.ones_like(rmin)
    scale = torch.where(rmin == rmax, ones, (ones * 255.0) / (rmax - rmin))
    recip = torch.where(scale != 0, ones / scale, torch.zeros_like(scale))
    low, high = rmin * scale, rmax * scale
    zero_point = torch.where((INT8_MIN + low) + (INT8_MAX + high) > 0, INT8_MIN - low, INT8_MAX - high)
    zero_point = torch.round(zero_point.clamp(INT8_MIN, INT8_MAX))  # half to even, as rintf
    # Half away from zero, in fp64 where |v| + 0.5 is exact (in fp32 0.49999997 + 0.5 rounds up to 1).
    scaled = (x * scale).double()
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    q = (rounded + zero_point.double()).clamp(INT8_MIN, INT8_MAX)
    return Int8Rows(q.to(torch.int8), zero_point.to(torch.int32), scale, recip)


def _group_sums(shifted: torch.Tensor, values: torch.Tensor, group_size: int) -> Iterator[torch.Tensor]:
    """Per group along K, in order: the exact integer sums ``sum_k shifted[m, k] * values[n, k]`` as
    fp64 ``[M, N]``: |q - zp| <= 255 and |w| <= 8, so every partial sum is an integer far below 2^53,
    exact in any summation order (and unaffected by torch's fp32 matmul precision setting)."""
    rows, cols = shifted.shape
    channels = values.shape[0]
    groups = cols // group_size
    chunk = max(1, _CHUNK_ELEMENTS // max(rows * channels, 1))
    for start in range(0, groups, chunk):
        count = min(chunk, groups - start)
        span = slice(start * group_size, (start + count) * group_size)
        lhs = shifted[:, span].double().view(rows, count, group_size).transpose(0, 1)  # [C, M, g]
        rhs = values[:, span].double().view(channels, count, group_size).permute(1, 2, 0)  # [C, g, N]
        yield from torch.bmm(lhs, rhs).unbind(0)


def _int8_dynamic_product(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """fp32 ``[M, N]``: KleidiAI's W4A8 product as torch's fallback computes it
    (``ref_dyn_quant_matmul_4bit_groupwise_kernel``; the channelwise kernel is the one-group case):
    per group an exact int32 sum of ``(q - zp) * w``, converted to fp32 and multiplied by the group's
    scale, accumulated in fp32 group by group, then multiplied by the row's ``recip``."""
    rows = quantize_int8_rows(a)
    shifted = rows.q.to(torch.int32) - rows.zero_point  # the kernels add -zp to q: same integers
    scales = b_scale.float()
    acc = a.new_zeros((a.shape[0], b.shape[0]), dtype=torch.float32)
    for group, sums in enumerate(_group_sums(shifted, unpack_int4(b), group_size)):
        acc = acc + sums.float() * scales[:, group]  # int32 -> fp32, times the scale, then added
    return acc * rows.recip


def int4_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    act_quant: str = "int8_dynamic",
) -> torch.Tensor:
    """Int4-weight matrix multiply: ``out = A @ dequant(b).T (+ bias)``.

    Args:
        a: ``[M, K]`` float32, bfloat16 or float16 activations, any strides; ``M >= 0``; finite (a
            row holding NaN or Inf has no int8 scale: its outputs are unspecified).
        b: ``[N, K/2]`` uint8 (weights, one row per output channel), two int4 codes per byte,
            element ``2j`` in the low nibble: ``b = w[:, 1::2] << 4 | w[:, ::2]`` with codes
            ``w = value + 8`` in 0..15 (symmetric int4: value ``code - 8`` in [-8, 7], no zero
            point). This is the layout torch's ``_dyn_quant_pack_4bit_weight`` takes. ``N >= 1``,
            ``K`` even and ``>= 2``.
        b_scale: ``[N, K / group_size]`` float32, bfloat16 or float16: weight ``[n, k]`` is
            ``(code - 8) * b_scale[n, k // group_size]``. Its dtype is part of the contract (and of
            the key): torch's op takes fp32 per-channel and bf16 per-group scales, and rounding
            fp32 group scales to bf16 would change the weights.
        group_size: elements of a row of ``b`` sharing a scale, a divisor of ``K``;
            ``group_size == K`` is per-channel (channelwise) scaling.
        bias: ``[N]`` in ``a``'s dtype, or None; added in fp32 before the single output rounding.
        act_quant: how ``A`` is made from ``a``.
            ``"int8_dynamic"`` (W4A8, KleidiAI's ``qai8dx`` x ``qsi4c32``/``qsi4cx`` kernels):
            each row quantized to int8 inside the op (``quantize_int8_rows``: asymmetric, per
            row, from the row's min and max), ``A = (q - zp) * recip``; the product is summed
            exactly in integers per group, each group's sum scaled by its weight scale and
            accumulated in fp32, the total scaled by the row's ``recip``. The quantization is part
            of the contract: a W4A16 result is outside a W4A8 call's tolerance.
            ``"none"`` (W4A16): ``A = a``, the product of ``a`` and the dequantized weights in fp32.

    Design: the weights are symmetric int4 (no zero point) as torch's and KleidiAI's int4 kernels
    take them; the activation quantization is a named option, not implied by ``a``'s dtype,
    because W4A8 and W4A16 kernels take the same operands and give different results; the
    output is ``a``'s dtype (torch's op returns its input's dtype), rounded once from fp32. The
    W4A8 reference reproduces torch 2.13's ``_dyn_quant_matmul_4bit`` fallback bit for bit (fp32).

    Returns:
        ``[M, N]`` in ``a``'s dtype.
    """
    if act_quant == "none":
        out = a.float() @ dequantize_int4(b, b_scale, group_size).T
    else:
        out = _int8_dynamic_product(a, b, b_scale, group_size)
    if bias is not None:
        out = out + bias.float()
    return out.to(a.dtype)


class Key(NamedTuple):
    """int4_mm's dispatch key: what an implementation may decide on (OpSpec.key). N, K and the group
    are the weight's, fixed per layer; M (tokens) changes per batch and is a class (``size_class``)."""

    device: torch.device
    a_dtype: torch.dtype  # also the output's and the bias's
    scale_dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]  # None: no bias
    act_quant: str
    n: int
    k: int  # unpacked: 2 * b.shape[1]
    group_size: int  # == k: channelwise
    m_class: int
    a_layout: Layout
    b_layout: Layout
    b_scale_layout: Layout
    bias_layout: Optional[Layout]


def validate(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    act_quant: str = "int8_dynamic",
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "a", a, dtypes=ACTIVATION_DTYPES, rank=2)
    device = a.device  # read once: building a torch.device costs ~0.3 us
    rows, cols = a.shape
    if cols < 2 or cols % 2:
        raise InvalidArgumentError(NAME, "a", "K = a.shape[1] even and >= 2 (two int4 codes per byte of b)",
                                   f"shape {tuple(a.shape)}")
    check_tensor(NAME, "b", b, dtypes=(torch.uint8,), rank=2, device=device)
    channels = b.shape[0]
    if b.shape[1] != cols // 2:
        raise InvalidArgumentError(NAME, "b", f"shape (N, {cols // 2}) (K/2, K = a.shape[1] = {cols})",
                                   f"shape {tuple(b.shape)}")
    if channels < 1:
        raise InvalidArgumentError(NAME, "b", "N = b.shape[0] >= 1", f"shape {tuple(b.shape)}")
    check_int(NAME, "group_size", group_size, low=1, high=cols)
    if cols % group_size:
        raise InvalidArgumentError(NAME, "group_size", f"a divisor of K = {cols}", group_size)
    check_tensor(NAME, "b_scale", b_scale, dtypes=SCALE_DTYPES, rank=2, device=device)
    if tuple(b_scale.shape) != (channels, cols // group_size):
        raise InvalidArgumentError(
            NAME, "b_scale", f"shape {(channels, cols // group_size)} (N, K / group_size)",
            f"shape {tuple(b_scale.shape)}",
        )
    bias_dtype = None
    if bias is not None:
        check_tensor(NAME, "bias", bias, dtypes=(a.dtype,), rank=1, device=device)
        if bias.shape[0] != channels:
            raise InvalidArgumentError(NAME, "bias", f"shape ({channels},) to match N = b.shape[0]",
                                       f"shape {tuple(bias.shape)}")
        bias_dtype = bias.dtype
    check_choice(NAME, "act_quant", act_quant, ACT_QUANTS)
    return Key(
        device, a.dtype, b_scale.dtype, bias_dtype, act_quant, channels, cols, group_size,
        size_class(rows), layout(a), layout(b), layout(b_scale), layout(bias),
    )


def fake(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    act_quant: str = "int8_dynamic",
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]))


# Closeness against the accumulation's magnitude, justified in specs/_tolerance.py.
TOLERANCE = GEMM_OUTPUT
# W4A8 kernels (KleidiAI's, XNNPACK's qd8) sum ``q * w`` and subtract ``zp * sum(w)`` from weight
# row sums packed beside the weights: those two terms, up to 128 / |q - zp| times the output's own,
# cancel in fp32. Weighted 2^-6 in the magnitude they add 2^-18 of recip * |zp| * sum |W| to the
# bound (specs/_tolerance.py: GEMM_OUTPUT, int4_mm).
ZERO_POINT_WEIGHT = 2.0**-6


def magnitude(kwargs: Mapping[str, Any]) -> torch.Tensor:
    """fp64 ``[M, N]``: the scale of an implementation's rounding error in each output
    (specs/_tolerance.py): ``sum_k |A||W| + |bias|``, ``A`` being ``a`` (W4A16) or the int8-quantized
    activations ``(q - zp) * recip`` (W4A8); for W4A8 plus ``ZERO_POINT_WEIGHT * recip * |zp| *
    sum_k |W|``, the terms that cancel in kernels that sum ``q * w`` and subtract ``zp * sum(w)``."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    weights = dequantize_int4(cpu["b"], cpu["b_scale"], cpu["group_size"]).abs().double()
    if cpu.get("act_quant", "int8_dynamic") == "none":
        mag = cpu["a"].abs().double() @ weights.T
    else:
        rows = quantize_int8_rows(cpu["a"])
        zero_point = rows.zero_point.double()
        shifted = (rows.q.double() - zero_point).abs()
        mag = (shifted @ weights.T + ZERO_POINT_WEIGHT * zero_point.abs() * weights.sum(dim=1)) * rows.recip.double()
    if cpu.get("bias") is not None:
        mag = mag + cpu["bias"].abs().double()
    return mag


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Elementwise within TOLERANCE[a's dtype], the absolute part scaled by ``magnitude``."""
    assert_same_kind(actual, expected, NAME)
    assert_close_to_magnitude(actual, expected, magnitude(kwargs), TOLERANCE[expected.dtype], NAME,
                              "sum_k |A||W| + |bias|")


def cost(kwargs: Mapping[str, Any]) -> Cost:
    a, b, b_scale, bias = kwargs["a"], kwargs["b"], kwargs["b_scale"], kwargs.get("bias")
    rows, channels, cols = a.shape[0], b.shape[0], 2 * b.shape[1]
    tensors = [t for t in (a, b, b_scale, bias) if t is not None]
    bytes_moved = sum(t.numel() * t.element_size() for t in tensors) + rows * channels * a.element_size()
    # W4A8 runs 8-bit integer dot products (Arm i8mm/dotprod, x86 VNNI); kernelmux's ceilings name
    # 8-bit rates "fp8" (int8 and fp8 share the tensor-core rate on Hopper; CPUs measure neither,
    # so the bench falls back to bf16). W4A16 dequantizes into a GEMM of a's dtype.
    if kwargs.get("act_quant", "int8_dynamic") == "int8_dynamic":
        rate = "fp8"
    else:
        rate = "fp32" if a.dtype == torch.float32 else "bf16"
    return Cost(flops=2 * rows * channels * cols, bytes=bytes_moved, matmul=rate)


# ---------------------------------------------------------------------------------------------
# Cases. Weights as a served checkpoint holds them: a trained layer's magnitudes (randn / sqrt(K),
# per-channel spread) quantized offline, symmetric, per group; activations drawn with outlier
# channels. fp32 activations are the model cases' (what KleidiAI's kernels take; vLLM's
# Dynamic4bitLinearKernel requires them on Arm).


def quantize_int4_weight(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 quantization of ``w [N, K]`` per group of ``group_size`` along K: scale =
    amax(group) / 8 rounded to ``scale_dtype``, values round-half-even(w / scale) clamped to [-8, 7]
    (the group's largest negative value lands on -8, its largest positive on 7), an all-zero group
    gets scale 0 and values 0. Returns ``(b [N, K/2] uint8, b_scale [N, K/group_size])``."""
    channels, cols = w.shape
    groups = w.float().view(channels, cols // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 8.0).to(scale_dtype)
    step = scale.float().unsqueeze(-1)
    values = torch.where(step > 0, groups / torch.where(step > 0, step, 1.0), 0.0)
    values = torch.round(values).clamp_(-8, 7).view(channels, cols)
    return pack_int4(values), scale


def _activations(rows: int, cols: int, generator: torch.Generator, kind: str) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=generator)
    if cols >= 16:  # outlier channels, as in real activations
        x[:, torch.randint(0, cols, (max(cols // 512, 1),), generator=generator)] *= 20.0
    if kind == "special":
        # Rows whose quantization is at a boundary: all zero (scale 1, zp 0), constant, all
        # positive (rmin 0: zp -128), all negative (rmax 0: zp 127), one huge outlier (most of the
        # row quantizes to the zero point).
        x[0] = 0.0
        x[1] = 0.75
        x[2] = x[2].abs()
        x[3] = -x[3].abs()
        x[4, 1] = 1e4
    return x


def _maker(
    rows: int,
    channels: int,
    cols: int,
    group_size: int,
    *,
    act_dtype: torch.dtype = torch.float32,
    scale_dtype: Optional[torch.dtype] = None,
    with_bias: bool = False,
    act_quant: str = "int8_dynamic",
    kind: str = "normal",
):
    # torch's conventions by default: fp32 scales per channel, bf16 per group.
    if scale_dtype is None:
        scale_dtype = torch.float32 if group_size == cols else torch.bfloat16

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        x = _activations(rows, cols, generator, kind).to(act_dtype)
        w = torch.randn(channels, cols, generator=generator).mul_(cols**-0.5)
        w.mul_(torch.rand(channels, 1, generator=generator) + 0.5)
        if kind == "special":
            w[::3] = 0.0  # whole zero channels: scale 0
            w[1::3, :group_size] = -0.0  # a zero first group of negative zeros
        b, b_scale = quantize_int4_weight(w, group_size, scale_dtype)
        bias = (torch.randn(channels, generator=generator) * 0.1).to(act_dtype) if with_bias else None
        tensors = {"a": x, "b": b, "b_scale": b_scale, "bias": bias}
        moved = {k: v.to(device) if v is not None else None for k, v in tensors.items()}
        return {**moved, "group_size": group_size, "act_quant": act_quant}

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    hidden, intermediate = 4096, 14336  # Llama-3-8B
    cases = []
    for m in (1, 32, 128):
        cases += [
            Case(f"llama3_8b_o_proj_m{m}_g32", _maker(m, hidden, hidden, 32), quick if m == 1 else model,
                 f"Llama-3-8B o_proj (4096 x 4096), groups of 32 (bf16 scales), {m} token(s)"),
            Case(f"llama3_8b_o_proj_m{m}_channelwise", _maker(m, hidden, hidden, hidden),
                 quick if m == 1 else model,
                 f"Llama-3-8B o_proj, per-channel fp32 scales (KleidiAI's qsi4cx kernels), {m} token(s)"),
        ]
    for m in (1, 128):
        cases += [
            Case(f"llama3_8b_gate_proj_m{m}_g32", _maker(m, intermediate, hidden, 32), model,
                 f"Llama-3-8B gate (or up) projection H 4096 -> I 14336, groups of 32, {m} token(s)"),
            Case(f"llama3_8b_down_proj_m{m}_g32", _maker(m, hidden, intermediate, 32), model,
                 f"Llama-3-8B down projection I 14336 -> H 4096 (448 groups a row), {m} token(s)"),
        ]
    cases += [
        Case("llama3_8b_kv_proj_m32_g128", _maker(32, 1024, hidden, 128), model,
             "Llama-3-8B k (or v) projection 4096 -> 8 x 128, groups of 128 (GPTQ/AWQ's usual group)"),
        Case("llama3_8b_o_proj_m32_w4a16_bf16", _maker(32, hidden, hidden, 128, act_dtype=torch.bfloat16,
                                                         act_quant="none"), model,
             "W4A16: bf16 activations used as they are, groups of 128"),
        Case("small_g32", _maker(7, 24, 96, 32), random, "three groups of 32, bf16 scales, fp32 activations"),
        Case("small_channelwise_bias", _maker(5, 40, 64, 64, with_bias=True), random,
             "per-channel fp32 scales and a bias"),
        Case("small_channelwise_bf16", _maker(6, 33, 128, 128, act_dtype=torch.bfloat16, with_bias=True),
             random, "bf16 activations and bias, odd N"),
        Case("small_g64_bf16", _maker(4, 16, 256, 64, act_dtype=torch.bfloat16), random,
             "bf16 activations with groups of 64"),
        Case("small_g32_fp16_bias", _maker(5, 20, 64, 32, act_dtype=torch.float16, with_bias=True), random,
             "fp16 activations and bias"),
        Case("small_g32_fp32_scales", _maker(3, 16, 128, 32, scale_dtype=torch.float32), random,
             "fp32 group scales (torch's op wants bf16 there)"),
        Case("small_channelwise_fp16_scales", _maker(4, 24, 96, 96, scale_dtype=torch.float16), random,
             "fp16 per-channel scales (GPTQ checkpoints)"),
        Case("small_w4a16_g32", _maker(6, 24, 128, 32, act_dtype=torch.bfloat16, act_quant="none"), random,
             "W4A16: bf16 activations unquantized"),
        Case("small_w4a16_channelwise_fp32_bias",
             _maker(3, 12, 64, 64, with_bias=True, act_quant="none"), random,
             "W4A16 with fp32 activations, per-channel scales and a bias"),
        Case("empty_g32", _maker(0, 64, 128, 32), edge, "M = 0: an empty batch gives [0, N]"),
        Case("empty_w4a16_channelwise", _maker(0, 16, 64, 64, act_quant="none", with_bias=True), edge,
             "M = 0 in W4A16 with a bias"),
        Case("one_token_g32", _maker(1, 64, 256, 32), edge, "M = 1: one decode token"),
        Case("one_channel_g32", _maker(3, 1, 128, 32), edge, "N = 1"),
        Case("k_equals_group", _maker(5, 16, 32, 32), edge, "K = group_size = 32: one group, channelwise"),
        Case("k2_channelwise", _maker(4, 8, 2, 2), edge, "K = 2: one byte of codes per channel"),
        Case("group_16", _maker(3, 16, 64, 16), edge, "groups of 16: the spec allows any divisor of K"),
        Case("special_rows_g32", _maker(6, 12, 64, 32, kind="special"), edge,
             "zero, constant, all-positive (zp -128), all-negative (zp 127) and outlier activation rows; "
             "zero weight channels and a group of -0.0 (scale 0)"),
        Case("special_rows_channelwise_bias", _maker(5, 9, 96, 96, kind="special", with_bias=True), edge,
             "the same boundary rows, per-channel scales and a bias"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn calls: 0-9 rows, 1-40 channels, K of 2-256 with a group size dividing it (channelwise
    included), every activation, scale and bias dtype, both activation modes, boundary rows."""
    cols = 2 * draw(st.integers(1, 128))
    group_size = draw(st.sampled_from(sorted({g for g in (2, 8, 32, 64, 128, cols) if cols % g == 0})))
    kind = draw(st.sampled_from(["normal", "special"]))
    rows = draw(st.integers(5 if kind == "special" else 0, 9))
    channels = draw(st.integers(1, 40))
    act_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    scale_dtype = draw(st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]))
    act_quant = draw(st.sampled_from(ACT_QUANTS))
    with_bias = draw(st.booleans())
    return drawn(f"M {rows}, N {channels}, K {cols}, group {group_size}, {str(act_dtype)[6:]} a, "
                 f"scales {str(scale_dtype)[6:] if scale_dtype else 'default'}, {act_quant}, bias {with_bias}, "
                 f"{kind} rows",
                 _maker(rows, channels, cols, group_size, act_dtype=act_dtype, scale_dtype=scale_dtype,
                        with_bias=with_bias, act_quant=act_quant, kind=kind))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=int4_mm,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    shapes=_shapes,
)
