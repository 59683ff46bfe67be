"""The triton backend's selective_state_update kernel: one Mamba2 decode step for a (request, block of heads, block of
head rows) per program (one grid axis, a request's tiles consecutive), its [HEADS, BLOCK_P, N] tile of the state
slot read once, updated in fp32, written once in place, and read out against C. A padding request (negative slot)
reads and writes no state and writes zeros to its rows of y. Host side: selective_state_update.py."""

import triton
import triton.language as tl

from kernelmux.backends.triton._mamba_kernel import time_step


@triton.jit
def selective_state_update_kernel(
        state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, slots_ptr, y_ptr,
        num_heads, head_dim, state_dim, heads_per_group,
        stride_ss, stride_sh, stride_sp, stride_sn, stride_xb, stride_xh, stride_xp, stride_tb, stride_th,
        stride_a, stride_bb, stride_bg, stride_bn, stride_cb, stride_cg, stride_cn, stride_d,
        stride_zb, stride_zh, stride_zp, stride_bias, stride_yb, stride_yh, stride_yp,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
        HAS_SLOTS: tl.constexpr, STATE_EVICTION: tl.constexpr, STATE_STORE_CACHE: tl.constexpr, HEADS: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Slot-major program order: consecutive programs walk one request's slot, tile after tile.
    row_blocks = tl.cdiv(head_dim, BLOCK_P)
    tiles = tl.cdiv(num_heads, HEADS) * row_blocks
    request = (tl.program_id(0) // tiles).to(tl.int64)
    heads = tl.program_id(0) % tiles // row_blocks * HEADS + tl.arange(0, HEADS)
    rows = tl.program_id(0) % row_blocks * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + request).to(tl.int64)
    else:
        slot = request
    # Masks as vectors (the interpreter takes no scalar in a mask): a padding request's are all off.
    live = (slot + tl.zeros_like(heads)) >= 0
    head_ok = heads < num_heads
    row_ok = (head_ok & live)[:, None] & (rows < head_dim)[None, :]  # [HEADS, BLOCK_P]
    col_ok = cols < state_dim
    tile_ok = row_ok[:, :, None] & col_ok[None, None, :]

    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + heads * stride_bias, mask=head_ok, other=0.0)
    step = time_step(tl.load(dt_ptr + request * stride_tb + heads * stride_th, mask=head_ok, other=0.0), bias,
                     HAS_BIAS, SOFTPLUS, 0.0, 0.0, False)  # [HEADS]
    decay = tl.exp(step * tl.load(a_ptr + heads * stride_a, mask=head_ok, other=0.0))
    x = tl.load(x_ptr + request * stride_xb + heads[:, None] * stride_xh + rows[None, :] * stride_xp, mask=row_ok,
                other=0.0).to(tl.float32)  # [HEADS, BLOCK_P]
    groups = heads // heads_per_group
    group_ok = head_ok[:, None] & col_ok[None, :]
    b = tl.load(b_ptr + request * stride_bb + groups[:, None] * stride_bg + cols[None, :] * stride_bn, mask=group_ok,
                other=0.0).to(tl.float32)  # [HEADS, BLOCK_N]
    c = tl.load(c_ptr + request * stride_cb + groups[:, None] * stride_cg + cols[None, :] * stride_cn, mask=group_ok,
                other=0.0).to(tl.float32)

    slot_ptrs = (state_ptr + slot * stride_ss + heads[:, None, None].to(tl.int64) * stride_sh
                 + rows[None, :, None].to(tl.int64) * stride_sp + cols[None, None, :] * stride_sn)
    # The state's cache hints (the host's: streaming, or "" for the defaults).
    old = tl.load(slot_ptrs, mask=tile_ok, other=0.0, eviction_policy=STATE_EVICTION).to(tl.float32)
    new = old * decay[:, None, None] + (step[:, None] * x)[:, :, None] * b[:, None, :]
    tl.store(slot_ptrs, new.to(state_ptr.dtype.element_ty), mask=tile_ok, cache_modifier=STATE_STORE_CACHE)

    y = tl.sum(new * c[:, None, :], axis=2)  # [HEADS, BLOCK_P], from the fp32 state
    if HAS_D:
        y += tl.load(d_ptr + heads * stride_d, mask=head_ok, other=0.0).to(tl.float32)[:, None] * x
    if HAS_Z:
        z = tl.load(z_ptr + request * stride_zb + heads[:, None] * stride_zh + rows[None, :] * stride_zp, mask=row_ok,
                    other=0.0).to(tl.float32)
        y *= z * tl.sigmoid(z)
    y = tl.where(row_ok, y, 0.0)  # a padding request's rows of y are zero
    y_ok = head_ok[:, None] & (rows < head_dim)[None, :]
    tl.store(y_ptr + request * stride_yb + heads[:, None] * stride_yh + rows[None, :] * stride_yp,
             y.to(y_ptr.dtype.element_ty), mask=y_ok)
