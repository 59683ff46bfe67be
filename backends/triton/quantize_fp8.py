"""The triton backend's quantize_fp8, every call the spec allows, and its launches (kernels:
_quantize_fp8_kernel.py, imported on the first launch so the backend registers without Triton):
per_token and per_group in one launch; per_tensor in one launch when one program holds every row,
else a pass of per-program maxima and the quantizing pass (no fill, no host sync). Scales are written
in the layout asked for (K-major, or MN-major for a TMA consumer: the kernels take the strides); both fp8
formats (e4m3fnuz's codes by the integer route)."""

import functools

import torch

from kernelmux.backends.triton._host import compute_units, device_guard, native_fp8_cast, next_pow2
from kernelmux.specs import quantize_fp8 as spec

__all__ = ["quantize_fp8"]

# per_tensor's rows per program and the row kernels' columns per step: 4 x 1024 fp32 lanes of a tile, two
# 16-byte vectors of bf16 per thread at 4 warps. BLOCK_K swept for per_token (below); ROWS not swept.
ROWS = 4
BLOCK_K = 1024
# per_tensor: up to this many rows one program reads every row (a tile of them, padded to a power of two),
# in a single launch (decode sizes).
ONE_PROGRAM_MAX_ROWS = ROWS
# per_token: rows per program. H200, T 4096, bf16, H 2048 / 7168: 12.9 / 43.1 us at 1 row against 14.5 / 50.5 at 4
# (13.3 / 47.0 at 2, 14.5 / 53.5 at 8; BLOCK_K 512 and 2048 slower at every height). At T 1, H 7168: 6.6 us
# against 38.3 for a 4-row tile (3 rows masked, their divisions still paid).
TOKEN_ROWS = 1
# per_token rows of at most this many columns are read once, whole, and kept in registers for their codes
# (ONE_STEP), by ONE_STEP_WARPS warps. H200, T 4096, bf16: H 2048 8.31 us one step against 9.88 in two
# passes (8 warps 9.63, 16 warps 13.36); H 7168 33.50 in two passes against 39.08 one step (8 warps 36.68):
# so up to 2048 (widths between not measured).
ONE_STEP_MAX_COLS = 2048
ONE_STEP_WARPS = 4
PARTIALS_BLOCK = 1024  # maxima read per step by the quantizing pass
GROUPS = 8  # per_group: groups of one row per program
# per_group rows of a multiple of WIDE_GROUPS groups take that many a program while the grid keeps at least
# WIDE_MIN_PROGRAMS_PER_UNIT programs per SM. H200, bf16, us: T 4096 x H 2048 (16 groups a row) 8.70-9.06 at 8
# groups a program against 8.17-8.23 at 16 (three alternations in one run; ue8m0 9.14-9.16 against 8.17-8.23);
# a sweep in another run: T 128 x 2048 (128 programs at 16) 1.75 at 8 against 1.99; H 7168 (56 groups) stays
# at 8: 27.71 against 33.23 at 16, 33.71 at 32, 39.83 at 4; 8 warps slower at every point. The floor sits
# between the measured 128 and 4096 programs.
WIDE_GROUPS = 16
WIDE_MIN_PROGRAMS_PER_UNIT = 4
# quantize_rows_kernel's AMAX
AMAX_ROW, AMAX_TILE, AMAX_PARTIALS = 0, 1, 2


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _quantize_fp8_kernel

    return _quantize_fp8_kernel


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    group_size: int = 128,
    ue8m0: bool = False,
    fp8_dtype: str = "e4m3fn",
    scale_layout: str = "k_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's quantize_fp8; arguments are validated by the caller."""
    rows, cols = x.shape
    device = x.device
    q, scale = spec.fake(x, granularity, group_size, ue8m0, fp8_dtype, scale_layout)  # the spec's shapes and strides
    if rows == 0:
        if granularity == "per_tensor":  # the amax of nothing is 0: the floor, a power of two already
            scale.fill_(spec.SCALE_FLOOR)
        return q, scale
    kernels = _kernels()
    codes = q.view(torch.uint8)  # the kernels write code bytes
    native = native_fp8_cast(device)
    fnuz = fp8_dtype == "e4m3fnuz"
    with device_guard(device):
        if granularity == "per_group":
            groups = scale.shape[1]
            per_program = GROUPS
            if groups % WIDE_GROUPS == 0 and (
                    rows * (groups // WIDE_GROUPS) >= WIDE_MIN_PROGRAMS_PER_UNIT * compute_units(device)):
                per_program = WIDE_GROUPS
            kernels.quantize_groups_kernel[(rows, -(-groups // per_program))](
                x, codes, scale, cols, group_size, groups, *x.stride(), codes.stride(0), *scale.stride(),
                UE8M0=ue8m0, NATIVE_FP8=native, FNUZ=fnuz, GROUPS=per_program, GROUP_PAD=next_pow2(group_size))
            return q, scale
        block_rows, block_k, one_step, warps = ROWS, BLOCK_K, False, 4
        partials = scale  # a placeholder unless per_tensor takes two passes
        if granularity == "per_token":
            amax, block_rows = AMAX_ROW, TOKEN_ROWS
            if cols <= ONE_STEP_MAX_COLS:
                block_k, one_step, warps = next_pow2(cols), True, ONE_STEP_WARPS
        elif rows <= ONE_PROGRAM_MAX_ROWS:
            amax, block_rows = AMAX_TILE, next_pow2(rows)
        else:
            amax = AMAX_PARTIALS
            partials = torch.empty(-(-rows // ROWS), dtype=torch.float32, device=device)
            kernels.amax_partials_kernel[(partials.numel(),)](x, partials, rows, cols, *x.stride(), ROWS=ROWS,
                                                              BLOCK_K=BLOCK_K)
        kernels.quantize_rows_kernel[(-(-rows // block_rows),)](
            x, codes, scale, partials, rows, cols, partials.numel(), *x.stride(), codes.stride(0), scale.stride(0),
            AMAX=amax, UE8M0=ue8m0, NATIVE_FP8=native, FNUZ=fnuz, ROWS=block_rows, BLOCK_K=block_k,
            BLOCK_P=PARTIALS_BLOCK, ONE_STEP=one_step, num_warps=warps)
    return q, scale
