"""The triton backend's quantize_fp8 kernels: rows (per token, or the whole tensor's one scale from its own
tile or from per-program partial maxima) and 1 x G groups, each reading its input once for the amax and
once for the codes (groups, and rows read whole in one step, once for both), with the spec's fp32
arithmetic (IEEE divisions, its floors, ue8m0 by the bits) and the shared code routines (e4m3fn, or
e4m3fnuz under FNUZ). Host side: quantize_fp8.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._fp8_kernel import FNUZ_MAX, FP8_MAX, e4m3fn_codes, e4m3fnuz_codes

GROUP_AMAX_FLOOR = tl.constexpr(1e-4)  # per_group floors the amax
SCALE_FLOOR = tl.constexpr(2.0**-126)  # per_token and per_tensor floor the scale
# Where quantize_rows_kernel's amax comes from (constexpr AMAX): each row's own (per_token), the whole
# tile's (per_tensor in one program), or amax_partials_kernel's maxima (per_tensor over many programs).
ROW = tl.constexpr(0)
TILE = tl.constexpr(1)
PARTIALS = tl.constexpr(2)


@triton.jit
def _scale(amax, GROUPED: tl.constexpr, UE8M0: tl.constexpr, FNUZ: tl.constexpr):
    """The spec's scale of a [n] vector of amax values: max(amax, 1e-4) / fp8_max for groups, else
    max(amax / fp8_max, 2^-126) (fp8_max 448, 240 under FNUZ); ue8m0 rounds it up to a power of two on
    the bits (a mantissa carries)."""
    fp8_max = tl.full(amax.shape, FNUZ_MAX if FNUZ else FP8_MAX, tl.float32)
    if GROUPED:
        scale = tl.math.div_rn(tl.maximum(amax, GROUP_AMAX_FLOOR), fp8_max)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, fp8_max), SCALE_FLOOR)
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & -0x800000).to(tl.float32, bitcast=True)
    return scale


# _codes divides by a row's (or group's) scale through its reciprocal and an FMA correction. Scales below
# RESCALE_BELOW (only rows' scales, floored at 2^-126, reach them; groups' are >= 1e-4 / 448) are multiplied
# by RESCALE, and the row with them (a power of two: exact, and |x| <= 448 scale keeps it far from overflow),
# so the FMA residual of any quotient the codes can tell apart (>= 2^-10, half of e4m3's smallest subnormal)
# stays >= 2^-134, above fp32's subnormals (2^-149): it is then exact.
RESCALE_BELOW = tl.constexpr(2.0**-100)
RESCALE = tl.constexpr(2.0**64)


@triton.jit
def _divisor(scale, GROUPED: tl.constexpr):
    """(factor, scale * factor, its correctly rounded reciprocal) of a row's or group's scale, for _codes
    (a group's factor is 1: the multiplications by it fold away)."""
    if GROUPED:
        factor = tl.full(scale.shape, 1.0, tl.float32)
    else:
        factor = tl.where(scale < RESCALE_BELOW, RESCALE, 1.0)
    scaled = scale * factor
    return factor, scaled, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scaled)


@triton.jit
def _codes(x, factor, scaled, reciprocal, NATIVE_FP8: tl.constexpr, FNUZ: tl.constexpr):
    """fp32 x [r, c] over its per-row scale ([r, 1] each, broadcast: _divisor's) -> e4m3fn (e4m3fnuz under
    FNUZ) codes, the IEEE division first: x times the reciprocal, corrected once by its FMA residual
    (Markstein), is the correctly rounded quotient given a correctly rounded reciprocal and a residual that
    neither overflows nor underflows (RESCALE_BELOW). div_rn would pay a range check and a branch per element."""
    x = x * tl.broadcast_to(factor, x.shape)
    scaled, reciprocal = tl.broadcast_to(scaled, x.shape), tl.broadcast_to(reciprocal, x.shape)
    quotient = x * reciprocal
    # The residual x - quotient * scale, exact (an FMA), as -(quotient * scale - x).
    quotient = tl.math.fma(-tl.math.fma(quotient, scaled, -x), reciprocal, quotient)
    # x's sign bit on the quotient: where the correction cancels the product exactly (a quotient below fp32's
    # smallest subnormal), the sum is +0, while the IEEE quotient of a negative x is -0 (and so is its code).
    x = (quotient.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32,
                                                                                                bitcast=True)
    # IN_RANGE: the quotients are within an ulp of fp8_max (x <= amax), and the spec leaves a NaN or Inf
    # input's codes unspecified.
    return e4m3fnuz_codes(x) if FNUZ else e4m3fn_codes(x, 0, NATIVE_FP8, IN_RANGE=True)


@triton.jit
def amax_partials_kernel(x_ptr, partial_ptr, rows, cols, stride_xm, stride_xk,
                         ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr = False):
    """partial[program] = max |x| over the program's ROWS rows (per_tensor's first pass); ATOMIC: the max of
    every program's in partial[0] (zeroed by the host), so the next pass reads one value (quantize_nvfp4)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    x_rows = x_ptr + row[:, None].to(tl.int64) * stride_xm
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (row < rows)[:, None] & (k < cols)[None, :]
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    if ATOMIC:
        tl.atomic_max(partial_ptr, tl.max(amax, axis=0))  # non-negative fp32: ordered as their bits
    else:
        tl.store(partial_ptr + tl.program_id(0), tl.max(amax, axis=0))


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, partial_ptr, rows, cols, num_partials,
                         stride_xm, stride_xk, stride_qm, stride_sm,
                         AMAX: tl.constexpr, UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, FNUZ: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, ONE_STEP: tl.constexpr):
    """Codes of the program's ROWS rows and their scale: per row (AMAX ROW, scale [M, 1]) or one for
    the tensor (TILE: this program's rows are all of it; PARTIALS: the first pass's maxima), stored by
    program 0 (scale [1]). ONE_STEP (BLOCK_K >= cols, AMAX ROW or TILE): the rows are read once and kept
    in registers from their maxima to their codes, instead of a second pass."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    x_rows = x_ptr + row[:, None].to(tl.int64) * stride_xm
    if ONE_STEP:
        tl.static_assert(AMAX != PARTIALS)
        k = tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (k < cols)[None, :]
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        if AMAX == TILE:
            amax = tl.zeros((ROWS,), dtype=tl.float32) + tl.max(amax, axis=0)
    elif AMAX == PARTIALS:
        amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for p0 in range(0, num_partials, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            amax = tl.maximum(amax, tl.load(partial_ptr + p, mask=p < num_partials, other=0.0))
        amax = tl.zeros((ROWS,), dtype=tl.float32) + tl.max(amax, axis=0)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (k < cols)[None, :]
            x = tl.load(x_rows + k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        if AMAX == TILE:
            amax = tl.zeros((ROWS,), dtype=tl.float32) + tl.max(amax, axis=0)
    scale = _scale(amax, False, UE8M0, FNUZ)
    if AMAX == ROW:
        tl.store(scale_ptr + row * stride_sm, scale, mask=row_ok)
    else:
        tl.store(scale_ptr + row, scale, mask=row == 0)  # the tensor's one scale, from row 0's lane
    q_rows = q_ptr + row[:, None].to(tl.int64) * stride_qm
    factor, scaled, reciprocal = _divisor(scale, False)
    factor, scaled, reciprocal = factor[:, None], scaled[:, None], reciprocal[:, None]
    if ONE_STEP:
        tl.store(q_rows + k[None, :], _codes(x, factor, scaled, reciprocal, NATIVE_FP8, FNUZ), mask=mask)
    else:
        for k0 in range(0, cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (k < cols)[None, :]
            x = tl.load(x_rows + k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k[None, :], _codes(x, factor, scaled, reciprocal, NATIVE_FP8, FNUZ), mask=mask)


@triton.jit
def quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, cols, group_size, num_groups,
                           stride_xm, stride_xk, stride_qm, stride_sm, stride_sg,
                           UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, FNUZ: tl.constexpr,
                           GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr):
    """per_group: GROUPS 1 x group_size groups of one row per program (GROUP_PAD >= group_size lanes
    each; a short last group reads only the columns it has), their scales and codes."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, GROUP_PAD)
    col = group[:, None] * group_size + lane[None, :]
    mask = (group < num_groups)[:, None] & (lane < group_size)[None, :] & (col < cols)
    x = tl.load(x_ptr + row * stride_xm + col * stride_xk, mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=1), True, UE8M0, FNUZ)
    tl.store(scale_ptr + row * stride_sm + group * stride_sg, scale, mask=group < num_groups)
    factor, scaled, reciprocal = _divisor(scale, True)
    tl.store(q_ptr + row * stride_qm + col,
             _codes(x, factor[:, None], scaled[:, None], reciprocal[:, None], NATIVE_FP8, FNUZ), mask=mask)
