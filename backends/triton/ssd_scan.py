"""The triton backend's ssd_scan: every call the spec allows (varlen batches with empty sequences, any strides,
every optional input, any power-of-two chunk), as the chunked SSD in six launches with no host sync (kernels:
_ssd_scan_kernel.py, imported on the first launch so the backend registers without Triton), and their tiles.
The chunk grids are sized by a bound on the chunk count, T // Q + Bs (each sequence adds at most one partial
chunk), and never larger than T."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends.triton._host import INTERPRETED, compute_units, device_guard, next_pow2
from kernelmux.platforms import Platform
from kernelmux.specs import ssd_scan as spec

__all__ = ["MAX_CHUNK", "MAX_STATE_DIM", "Tiles", "describe", "ssd_scan", "supports", "tiles_for"]

# Not run past these: a chunk's running sums are a [heads, Q] tile of one program, and C.B is a Q x Q fp32
# buffer per chunk and group (Mamba2 uses Q 256, N 128; the tests reach Q 256 and N 128).
MAX_CHUNK = 1024
MAX_STATE_DIM = 1024
MIN_DOT = 16  # tl.dot's smallest dims
# chunk_table_kernel's sequences per step (of the sequences before a program's) and chunks per store.
TABLE_BLOCK = 256


@dataclass(frozen=True)
class Tiles:
    """Every launch's tile dims (powers of two, at least MIN_DOT where they feed a dot), and warps."""

    cumsum_heads: int
    cb_m: int
    cb_n: int
    cb_k: int
    state_p: int
    state_n: int
    state_t: int
    scan_m: int
    scan_p: int
    scan_k: int
    scan_j: int
    num_warps: int  # chunk_cb's and chunk_state's
    scan_warps: int
    num_stages: int  # the dot kernels' software pipelining
    passing_block: int  # state elements per state_passing program
    passing_warps: int
    walk_p: int  # state_walk's state tile and tokens a step
    walk_n: int
    walk_t: int
    walk_warps: int


def _dot_dim(n: int, cap: int) -> int:
    return max(MIN_DOT, min(next_pow2(n), cap))


def tiles_for(chunk: int, head_dim: int, state_dim: int) -> Tiles:
    """The launches' tiles, measured on the H200 at Mamba2-2.7B (perf/decisions/ssd_scan.md: three stages, 32-token
    scan steps, 128-token walk steps); under the interpreter whole chunks, heads and states per program (a program
    costs ~10 ms whatever its size)."""
    cap = 1 << 30 if INTERPRETED else 64
    q = _dot_dim(chunk, cap)
    return Tiles(
        cumsum_heads=max(1, min(16, 4096 // chunk)) if not INTERPRETED else 64,
        cb_m=q, cb_n=q, cb_k=_dot_dim(state_dim, cap),
        state_p=_dot_dim(head_dim, cap), state_n=_dot_dim(state_dim, cap), state_t=q,
        scan_m=q, scan_p=_dot_dim(head_dim, cap), scan_k=_dot_dim(state_dim, cap),
        scan_j=min(q, 32) if not INTERPRETED else q, num_warps=4, scan_warps=4, num_stages=3,
        passing_block=next_pow2(head_dim * state_dim) if INTERPRETED else 1024, passing_warps=4,
        walk_p=_dot_dim(head_dim, cap), walk_n=_dot_dim(state_dim, cap), walk_t=_dot_dim(chunk, 2 * cap),
        walk_warps=4)


_sm_count = compute_units  # (a module name of its own: tests pin it)


def walks(programs: int, device: torch.device) -> bool:
    """Whether the states go by state_walk_kernel: when its programs (a sequence, head and state tile each) fill the
    GPU's SMs, for each walks its sequence's chunks one after another. H200, Mamba2-2.7B at 1 x 8192 tokens, the whole
    call: 80 heads (160 programs) 406 us against 429 by chunk states and state passing; 40 heads (80 programs) 242
    against 235, 20 heads 162 against 133 (perf/decisions/ssd_scan.md). Under the interpreter always (the tests force
    the other route)."""
    return INTERPRETED or programs >= _sm_count(device)


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None up to MAX_CHUNK and MAX_STATE_DIM (any strides, dtypes, options), else why not."""
    if key.chunk_size > MAX_CHUNK:
        return (f"chunk_size {key.chunk_size} > {MAX_CHUNK}: a chunk's running sums are one program's tile "
                "(not run past it)")
    if key.state_dim > MAX_STATE_DIM:
        return f"state dim N = {key.state_dim} > {MAX_STATE_DIM} (not run past it)"
    return None


def describe(key: spec.Key, platform: Platform) -> str:
    """The chunked launches a call with ``key`` runs (for explain)."""
    t = tiles_for(key.chunk_size, key.head_dim, key.state_dim)
    return (f"chunk {key.chunk_size}: C.B tiles {t.cb_m} x {t.cb_n}; states by a walk over each sequence's chunks "
            f"({t.walk_p} x {t.walk_n} state tiles, {t.walk_t} tokens a step) when its programs fill the SMs, else "
            f"chunk states {t.state_p} x {t.state_n} by {t.state_t} tokens and state passing; scan {t.scan_m} tokens x "
            f"{t.scan_p} of P by {t.scan_k} of N ({t.scan_warps} warps), {t.num_stages} stages")


@functools.cache
def _kernels():
    from kernelmux.backends.triton import _ssd_scan_kernel

    return _ssd_scan_kernel


def _dot_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, object]:
    """(the torch dtype, the Triton dtype) the dots multiply in: the activations' (fp32 under the interpreter)."""
    import triton.language as tl

    if INTERPRETED:
        return torch.float32, tl.float32
    return dtype, {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


# The scan's elementwise exponentials and gate division approximate on the GPU (no inline PTX under the interpreter).
FAST_MATH = not INTERPRETED

# fp32 dots at 3xTF32 (one TF32 pass was off by up to 8e-3 against the fp32 reference on Mamba2-2.7B, the
# tolerance 1e-3); 16-bit operands take no such setting.
FP32_DOT_PRECISION = "tf32x3"


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = spec.NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's ssd_scan; arguments are validated by the caller."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    num_seqs = cu_seqlens.shape[0] - 1
    device = x.device
    y, final = spec.fake(x, dt, A, B, C, cu_seqlens)
    if num_seqs == 0:
        return y, final
    kernels = _kernels()
    cu_seqlens = cu_seqlens.contiguous()  # the kernels index it densely; a strided view is copied (Bs + 1 ints)
    q = chunk_size
    max_chunks = min(num_tokens // q + num_seqs, num_tokens)
    t = tiles_for(q, head_dim, state_dim)
    heads_per_group = num_heads // num_groups
    dot_dtype, dot = _dot_dtypes(x.dtype)
    precision = FP32_DOT_PRECISION if dot_dtype == torch.float32 and not INTERPRETED else "tf32"
    # The chunk table, dt' and its running sums, C.B, the chunk states and the states entering the chunks.
    first = torch.empty(num_seqs + 1, dtype=torch.int32, device=device)
    chunk_seq = torch.empty(max(max_chunks, 1), dtype=torch.int32, device=device)
    chunk_start = torch.empty_like(chunk_seq)
    step = torch.empty((num_heads, max_chunks, q), dtype=torch.float32, device=device)
    cum = torch.empty_like(step)
    cb = torch.empty((max_chunks, num_groups, q, q), dtype=torch.float32, device=device)
    starts = torch.empty((max_chunks, num_heads, head_dim, state_dim), dtype=dot_dtype, device=device)
    walk_grid = (num_seqs, num_heads, -(-head_dim // t.walk_p) * -(-state_dim // t.walk_n))
    walk = walks(walk_grid[0] * walk_grid[1] * walk_grid[2], device)
    states = None if walk else torch.empty(starts.shape, dtype=torch.float32, device=device)
    placeholder = x  # absent optional tensors: never read (their HAS_ flag is off)
    clamp = dt_min > 0.0 or dt_max < spec.NO_UPPER_DT_LIMIT
    lists = (first, chunk_seq, chunk_start, cu_seqlens)
    init = initial_states if initial_states is not None else final
    with device_guard(device):
        kernels.chunk_table_kernel[(num_seqs + 1,)](cu_seqlens, first, chunk_seq, chunk_start, num_seqs, CHUNK=q,
                                                    BLOCK_S=TABLE_BLOCK, BLOCK_C=TABLE_BLOCK)
        if max_chunks:
            kernels.chunk_cumsum_kernel[(max_chunks, -(-num_heads // t.cumsum_heads))](
                dt, A, dt_bias if dt_bias is not None else placeholder, *lists, step, cum, num_seqs, num_heads,
                float(dt_min), min(float(dt_max), spec.NO_UPPER_DT_LIMIT), *dt.stride(), A.stride(0),
                dt_bias.stride(0) if dt_bias is not None else 0, *step.stride()[:2],
                HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, CLAMP=clamp, CHUNK=q, BLOCK_H=t.cumsum_heads)
            kernels.chunk_cb_kernel[(max_chunks, num_groups, -(-q // t.cb_m) * -(-q // t.cb_n))](
                B, C, *lists, cb, num_seqs, state_dim, *B.stride(), *C.stride(), *cb.stride()[:2],
                DOT=dot, PRECISION=precision, CHUNK=q, BLOCK_M=t.cb_m, BLOCK_N=t.cb_n, BLOCK_K=t.cb_k,
                num_warps=t.num_warps, num_stages=t.num_stages)
        if walk:
            kernels.state_walk_kernel[walk_grid](
                x, B, step, cum, first, cu_seqlens, init, starts, final, head_dim, state_dim, heads_per_group,
                *x.stride(), *B.stride(), *step.stride()[:2], *starts.stride()[:2], *init.stride(),
                *final.stride()[:2], HAS_INIT=initial_states is not None, DOT=dot, PRECISION=precision, CHUNK=q,
                BLOCK_P=t.walk_p, BLOCK_N=t.walk_n, BLOCK_T=t.walk_t, STEPS=max(1, q // t.walk_t),
                num_warps=t.walk_warps, num_stages=t.num_stages)
        else:
            if max_chunks:
                kernels.chunk_state_kernel[(max_chunks, num_heads,
                                            -(-head_dim // t.state_p) * -(-state_dim // t.state_n))](
                    x, B, step, cum, *lists, states, num_seqs, head_dim, state_dim, heads_per_group, *x.stride(),
                    *B.stride(), *step.stride()[:2], *states.stride()[:2],
                    DOT=dot, PRECISION=precision, CHUNK=q, BLOCK_P=t.state_p, BLOCK_N=t.state_n, BLOCK_T=t.state_t,
                    num_warps=t.num_warps, num_stages=t.num_stages)
            kernels.state_passing_kernel[(num_seqs, num_heads, -(-(head_dim * state_dim) // t.passing_block))](
                states, cum, first, init, starts, final, head_dim, state_dim, *step.stride()[:2],
                *states.stride()[:2], *init.stride(), *final.stride()[:2],
                HAS_INIT=initial_states is not None, CHUNK=q, BLOCK=t.passing_block, num_warps=t.passing_warps)
        if max_chunks:
            zz = z if z is not None else placeholder
            kernels.chunk_scan_kernel[(max_chunks, num_heads, -(-q // t.scan_m) * -(-head_dim // t.scan_p))](
                x, C, D if D is not None else placeholder, zz, step, cum, cb, starts, *lists, y, num_seqs, head_dim,
                state_dim, heads_per_group, *x.stride(), *C.stride(), D.stride(0) if D is not None else 0,
                *(zz.stride() if z is not None else (0, 0, 0)), *y.stride(), *step.stride()[:2], *cb.stride()[:2],
                *starts.stride()[:2],
                HAS_D=D is not None, HAS_Z=z is not None, DOT=dot, PRECISION=precision, CHUNK=q, BLOCK_M=t.scan_m,
                BLOCK_P=t.scan_p, BLOCK_K=t.scan_k, BLOCK_J=t.scan_j, FAST=FAST_MATH, num_warps=t.scan_warps,
                num_stages=t.num_stages)
    return y, final
