"""The triton backend's tile order for its GEMMs (fused_moe, scaled_mm, fp4_mm): which output tile a program
computes. Host side: none (each op's launch sizes its grid)."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(num_tiles_m, size_n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile of rows, tile of columns) of program axis 0 over num_tiles_m x cdiv(size_n, BLOCK_N) tiles: GROUP_M
    row tiles sweep a column tile together, so the weight tile they share is read from L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(size_n, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    rows = tl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows
