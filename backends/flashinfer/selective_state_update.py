"""The flashinfer backend's selective_state_update: FlashInfer's Mamba decode step
(flashinfer.mamba.selective_state_update) fed the spec's per-head A, D, dt and dt_bias as the
stride-0 broadcasts of its "tie_hdim" form, with the spec's padding convention kept."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.flashinfer import FLASHINFER
from kernelmux.platforms import Platform
from kernelmux.specs import selective_state_update as spec

__all__ = ["selective_state_update", "supports"]

_log = logging.getLogger(__name__)

# The JIT builds a generic module for sm_8x, an "sm90" one for sm_9x and an "sm100" one from
# sm_10x up (mamba/selective_state_update.py _get_module; jit/mamba's supported_major_versions).
CAPABILITIES = frozenset({(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)})
# DSTATE is a template constant: getVectorLoadSizeForFullUtilization<state_t, DSTATE>() gives
# DSTATE / 32 elements per lane, which must be a power of two > 0 (PackedAligned, common.cuh),
# and the TMA box of the producer/consumer kernels holds a whole state row (<= 256 elements).
STATE_DIMS = (32, 64, 128, 256)
# DIM (the head dim P) is one too, and every module also instantiates the multi-token "simple" kernel
# for 4, 2 and 1 CTAs per head wherever DIM / CTAs >= 16 rows, each needing DIM / CTAs % 16 == 0
# (dispatchCtasPerHead, kernel_selective_state_update_mtp_simple.cuh), and the sm_9x+ module the
# horizontal kernel with (P / 64) * 4 consumer warps (a static_assert that they cover a row). On the
# H200 P = 64 and 192 compiled; 16, 48, 80 and 96 failed to compile (stop 41).
HEAD_DIM_MULTIPLE = 64
# algorithm="auto" picks by batch * heads vs SMs (invokeSelectiveStateUpdate): "vertical" (sm_9x+)
# pipelines 16-row stages (dim % 16, dim >= 48: its write-only drain starts at DIM/16 - 3) and
# writes y from 4 warps of 32 lanes (dim <= 128); "horizontal" (sm_10x+, 16-bit state) runs
# dim / 64 * 4 consumer warps (dim % 64). Other head dims use "simple", which takes any dim.
AUTO_HEAD_DIMS = (64, 128)
PAD_SLOT = -1  # pad_slot_id: the kernel skips a slot equal to it, compared exactly
VECTOR_BYTES = 16  # check_ptr_alignment_input_vars: x, z, B, C pointers and batch strides
TMA_BYTES = 128  # FLASHINFER_CHECK_TMA_ALIGNED on x, B, C, z and the state (vertical/horizontal)
WHERE = "JIT with nvcc into FlashInfer's cache, $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default ~)"

_warned_state_copy = False


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when FlashInfer's kernel computes this call as the spec defines it, else why not."""
    if platform.capability not in CAPABILITIES:
        return (f"flashinfer's selective_state_update builds for sm_80 to sm_121 (sm_80, sm_86, sm_89, sm_90, "
                f"sm_100, sm_103, sm_120, sm_121), not {platform.arch}")
    if key.state_dim not in STATE_DIMS:
        return (f"state dim N = {key.state_dim}: the kernel is compiled for N with N / 32 a power of two, "
                f"{', '.join(map(str, STATE_DIMS))} (its per-lane vector loads)")
    if key.head_dim % HEAD_DIM_MULTIPLE:
        return (f"head dim P = {key.head_dim}: FlashInfer's module compiles only for P a multiple of "
                f"{HEAD_DIM_MULTIPLE} (its kernels' per-CTA row tiling and consumer warps are templates on P; "
                "other P fail its static_asserts)")
    if not key.state_layout.dense_rows:
        # The cache is updated in place, so it cannot be copied into an aligned one per call.
        return ("the state cache's rows must be contiguous and 16-byte aligned (the kernel loads "
                f"16-byte vectors of it), got {key.state_layout}")
    # x and z go packed, one request per Hh * P elements: with P % 64 == 0 that batch stride is whole
    # 16-byte vectors, as check_ptr_alignment_input_vars needs.
    return None


def _algorithm(head_dim: int) -> str:
    return "auto" if head_dim in AUTO_HEAD_DIMS else "simple"


def _kernel_rows(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``t`` (``[Bs, rows, cols]``) as the kernel addresses it: packed inner dims (stride(1) == cols,
    stride(2) == 1), 16-byte batch stride, an ``alignment``-byte aligned base; a packed copy when
    it is not."""
    _, rows, cols = t.shape
    size = t.element_size()
    if (t.stride(2) == 1 and t.stride(1) == cols and (t.stride(0) * size) % VECTOR_BYTES == 0
            and t.data_ptr() % alignment == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _kernel_vector(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[Hh]`` parameter in ``dtype`` with unit stride, as the broadcast views need."""
    t = t.to(dtype)
    return t if t.stride(0) == 1 else t.clone(memory_format=torch.contiguous_format)


def _state_in_kernel_layout(state: torch.Tensor, alignment: int) -> bool:
    _, heads, head_dim, state_dim = state.shape
    return (tuple(state.stride()[1:]) == (head_dim * state_dim, state_dim, 1)
            and (state.stride(0) * state.element_size()) % VECTOR_BYTES == 0
            and state.data_ptr() % alignment == 0)


def _weight_dtype(*dtypes: Optional[torch.dtype]) -> torch.dtype:
    """The one dtype the kernel reads dt, D and dt_bias in (validate_dtype_consistency): theirs
    when they agree, else fp32, to which each converts exactly (the kernel computes in fp32)."""
    present = {d for d in dtypes if d is not None}
    return present.pop() if len(present) == 1 else torch.float32


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
    """The spec's selective_state_update on flashinfer.mamba.selective_state_update; arguments are
    validated by the caller and accepted by supports."""
    from flashinfer.mamba import selective_state_update as vendor_ssu

    requests, heads, head_dim = x.shape
    slots, _, _, state_dim = state.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if requests == 0:
        return y
    if slots == 0:
        # Only possible with indices that are all padding (validate: S == Bs without indices).
        return y.zero_()
    algorithm = _algorithm(head_dim)
    alignment = TMA_BYTES if algorithm == "auto" else VECTOR_BYTES
    weight_dtype = _weight_dtype(dt.dtype, D.dtype if D is not None else None,
                                 dt_bias.dtype if dt_bias is not None else None)

    # The kernel reads A[h], D[h], dt_bias[h] and dt[b, h] through tensors shaped like its per-dim
    # form and checks they are broadcasts: A [Hh, P, N] strides (1, 0, 0), D and dt_bias [Hh, P]
    # (1, 0), dt [Bs, Hh, P] (., 1, 0) (selective_state_update.cu validate_*).
    A_view = _kernel_vector(A, torch.float32)[:, None, None].expand(heads, head_dim, state_dim)
    if D is None:  # its D is required; a zero skip connection adds exactly nothing
        D = torch.zeros(heads, dtype=weight_dtype, device=x.device)
    D_view = _kernel_vector(D, weight_dtype)[:, None].expand(heads, head_dim)
    bias_view = (None if dt_bias is None
                 else _kernel_vector(dt_bias, weight_dtype)[:, None].expand(heads, head_dim))
    dt = dt.to(weight_dtype)
    if dt.stride(1) != 1:
        dt = dt.clone(memory_format=torch.contiguous_format)
    dt_view = dt[:, :, None].expand(requests, heads, head_dim)

    indices = padding = None
    if state_batch_indices is not None:
        # The spec pads with any negative slot, the kernel skips only pad_slot_id (an exact
        # compare); map every negative to it on the device (no sync).
        indices = state_batch_indices.clamp_min(PAD_SLOT)
        padding = state_batch_indices < 0

    work = state
    if not _state_in_kernel_layout(state, alignment):
        # Rare (a view of a cache, or a base off 128 bytes): the kernel takes no strides for the
        # inner dims, so it runs on a packed copy of the whole cache, copied back.
        global _warned_state_copy
        if not _warned_state_copy:
            _warned_state_copy = True
            _log.warning("kernelmux: flashinfer selective_state_update: the state cache (strides %s) is not "
                         "in the kernel's layout; running on a packed copy (2x the cache's traffic)",
                         tuple(state.stride()))
        work = state.clone(memory_format=torch.contiguous_format)

    variant = (state.dtype, x.dtype, weight_dtype, head_dim, state_dim)
    # The kernel checks state.size(0) >= batch; a padded batch may exceed the cache (the spec
    # allows S < Bs with indices): run it in chunks of at most S requests (no sync either way).
    for start in range(0, requests, slots):
        end = min(start + slots, requests)
        part = slice(start, end)
        out = y[part]  # contiguous: rows of a fresh y

        def call(part=part, out=out):
            vendor_ssu(
                state=work,
                x=_kernel_rows(x[part], alignment),
                dt=dt_view[part],
                A=A_view,
                B=_kernel_rows(B[part], alignment),
                C=_kernel_rows(C[part], alignment),
                D=D_view,
                z=None if z is None else _kernel_rows(z[part], alignment),
                dt_bias=bias_view,
                dt_softplus=dt_softplus,
                state_batch_indices=None if indices is None else indices[part],
                pad_slot_id=PAD_SLOT,
                out=out,
                algorithm=algorithm,
            )

        first_calls.run(FLASHINFER, spec.NAME, variant, WHERE, call)
    if work is not state:
        state.copy_(work)
    if padding is not None:
        # The kernel still writes a padding request's y (D * x, gated, from a zero state); the
        # spec's row is zero.
        y.masked_fill_(padding[:, None, None], 0)
    return y
