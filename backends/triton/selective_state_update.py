"""The triton backend's selective_state_update: every call the spec allows (any strides, fp32 and bf16 states,
padding requests, every optional input) in one launch, and its tile (kernel: _selective_state_update_kernel.py,
imported on the first launch so the backend registers without Triton). The op is a stream over the state
slots: each program reads its tile once and writes it once, and the tile is sized for enough loads in flight."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends.triton._host import INTERPRETED, device_guard, next_pow2
from kernelmux.platforms import Platform
from kernelmux.specs import selective_state_update as spec

__all__ = ["MAX_STATE_DIM", "Tile", "describe", "selective_state_update", "supports", "tile_for"]

# A program holds whole state rows (N columns) in registers: past this N a row alone would spill.
MAX_STATE_DIM = 4096
# State elements per program on the GPU, warps, and streaming cache hints on the state (loaded evict-first, stored
# .cs), programs in slot-major order (the kernel's): Mamba2-2.7B on the H200, fp32 state, B 64 / 256: 85.7 / 337.9 us
# (92.6 / 94.0% of copy) against 89.1 / 353.6 at 2 warps in request-major order (the first tile), 88.0 / 352.3 at 1
# warp in request-major order; bf16 state B 64: 44.2 against 48.7 (perf/decisions/selective_state_update.md).
TILE_ELEMENTS = 1024
NUM_WARPS = 1
STREAM_HINTS = True
# The hints (the kernel's STATE_EVICTION, STATE_STORE_CACHE): the state is touched once, so it should not evict
# what the head's other programs reread (x, B, C, dt).
_STREAMING = ("evict_first", ".cs")
_DEFAULT_CACHING = ("", "")
# Under the interpreter a program costs ~10 ms whatever its size: as many heads and rows as fit this many
# elements go to one program.
INTERPRETER_TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Tile:
    """Heads and head rows per program (the state dim is whole), and warps."""

    heads: int
    block_p: int
    num_warps: int


def tile_for(num_heads: int, head_dim: int, state_dim: int) -> Tile:
    """The program's tile: rows of one head up to TILE_ELEMENTS state elements on the GPU; under the
    interpreter every head and row that fit INTERPRETER_TILE_ELEMENTS."""
    block_n = next_pow2(state_dim)
    if INTERPRETED:
        block_p = min(next_pow2(head_dim), max(1, INTERPRETER_TILE_ELEMENTS // block_n))
        heads = min(next_pow2(num_heads), max(1, INTERPRETER_TILE_ELEMENTS // (block_n * block_p)))
        return Tile(heads, block_p, 1)
    return Tile(1, min(next_pow2(head_dim), max(1, TILE_ELEMENTS // block_n)), NUM_WARPS)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None up to MAX_STATE_DIM (any strides, dtypes and options), else why not."""
    if key.state_dim > MAX_STATE_DIM:
        return (f"state dim N = {key.state_dim} > {MAX_STATE_DIM}: a program holds whole state rows in "
                "registers")
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """The tile a call with ``key`` runs (for explain)."""
    tile = tile_for(key.num_heads, key.head_dim, key.state_dim)
    return (f"a program per request x {tile.heads} head(s) x {tile.block_p} of P rows, whole N, {tile.num_warps} "
            "warps")


@functools.cache
def _kernel():
    from kernelmux.backends.triton._selective_state_update_kernel import selective_state_update_kernel

    return selective_state_update_kernel


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    state_batch_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's selective_state_update in one launch; arguments are validated by the caller."""
    num_requests, num_heads, head_dim = x.shape
    state_dim = state.shape[3]
    y = spec.fake(state, x, dt, A, B, C)  # every element written (zeros for padding)
    if y.numel() == 0:
        return y
    tile = tile_for(num_heads, head_dim, state_dim)
    grid = (num_requests * -(-num_heads // tile.heads) * -(-head_dim // tile.block_p),)
    placeholder = x  # for absent optional tensors: never read (their HAS_ flag is off)
    d, zz, bias, slots = (t if t is not None else placeholder for t in (D, z, dt_bias, state_batch_indices))
    z_strides = zz.stride() if z is not None else (0, 0, 0)
    eviction, store_cache = _STREAMING if STREAM_HINTS else _DEFAULT_CACHING
    with device_guard(x.device):
        _kernel()[grid](
            state, x, dt, A, B, C, d, zz, bias, slots, y,
            num_heads, head_dim, state_dim, num_heads // B.shape[1],
            *state.stride(), *x.stride(), *dt.stride(), A.stride(0), *B.stride(), *C.stride(),
            D.stride(0) if D is not None else 0, *z_strides, dt_bias.stride(0) if dt_bias is not None else 0,
            *y.stride(),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            HAS_SLOTS=state_batch_indices is not None, STATE_EVICTION=eviction, STATE_STORE_CACHE=store_cache,
            HEADS=tile.heads, BLOCK_P=tile.block_p, BLOCK_N=next_pow2(state_dim), num_warps=tile.num_warps)
    return y
