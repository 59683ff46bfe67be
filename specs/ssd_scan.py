"""ssd_scan: the Mamba2 state-space scan over packed variable-length prefill sequences (chunked
SSD form); the spec, its reference and its cases."""

import math
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import enforce, offsets_rules
from kernelmux.specs._compare import assert_close
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_int, check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["NO_UPPER_DT_LIMIT", "SPEC", "Key", "ssd_scan"]

NAME = "ssd_scan"
# x, z, B and C are the layer's activations and share one dtype; y comes back in it.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# dt comes from the input projection (activation dtype) and D, dt_bias are parameters that
# engines keep in fp32 or in the activation dtype; each is upcast exactly.
PARAM_DTYPES = ACTIVATION_DTYPES
# torch's schema parser rejects `inf` as a default, so "no upper limit" is the largest fp32:
# any dt_max >= this (float("inf") included) clamps nothing, since dt' is computed in fp32.
NO_UPPER_DT_LIMIT = float(torch.finfo(torch.float32).max)


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
    dt_max: float = NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Mamba2 selective scan over each of the ``Bs`` packed sequences; chunked SSD in fp32.

    Per sequence and head ``h`` (group ``g = h // (Hh / G)``), for its tokens ``t`` in order:
    ``dt' = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, dt_min, dt_max)``,
    ``state_t = exp(dt' * A) * state_{t-1} + dt' * outer(x_t, B_t)`` (``[P, N]``),
    ``y_t = state_t @ C_t + D * x_t``, then ``y_t *= silu(z_t)`` when ``z`` is given.

    Args:
        x: ``[T, Hh, P]`` fp32/bf16/fp16, the tokens of all sequences packed back to back.
        dt: ``[T, Hh]`` fp32/bf16/fp16, the raw time step.
        A: ``[Hh]`` fp32, negative (``-exp(A_log)``). Not checked (a value check would sync the
            device); for ``A >= 0`` implementations may differ (kernels assume decay <= 1).
        B: ``[T, G, N]``, x's dtype; ``Hh % G == 0``.
        C: ``[T, G, N]``, x's dtype.
        cu_seqlens: ``[Bs + 1]`` int32 on x's device: ``0 = c_0 <= c_1 <= ... <= c_Bs = T``;
            sequence ``s`` is tokens ``c_s:c_{s+1}`` and may be empty (its final state is its
            initial state). Checked in checked mode only (``check_data``: values need a sync).
        D: ``[Hh]`` or None (no skip connection).
        z: ``[T, Hh, P]`` x's dtype, or None (no gate).
        dt_bias: ``[Hh]`` or None (zero).
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_min, dt_max: the clamp of ``dt'``, ``0 <= dt_min <= dt_max``; ``dt_max >=
            NO_UPPER_DT_LIMIT`` (the default, or ``inf``) means no upper limit. Precondition:
            ``dt' >= 0`` before the clamp (always true with softplus); for negative ``dt'`` the
            default limits clamp to 0 here while mamba_ssm's kernels skip the clamp.
        initial_states: ``[Bs, Hh, P, N]`` fp32 or None (zeros).
        chunk_size: ``Q``, a positive power of two. Chunks restart at each sequence's first token.
            The result does not depend on ``Q`` in exact arithmetic; it sets the rounding, and it
            is the tiling every fast kernel uses, so the reference uses it too.

    Returns:
        ``y [T, Hh, P]`` in x's dtype and ``final_states [Bs, Hh, P, N]`` fp32 (each sequence's
        state after its last token).
    """
    return _ssd_scan(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                     initial_states, chunk_size, torch.float32)


def _ssd_scan(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max,
              initial_states, chunk_size, compute_dtype):
    """The reference's body, computing in ``compute_dtype`` (tests run it in fp64 to prove the
    algorithm against the step-by-step recurrence, free of fp32 rounding)."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    head_group = torch.arange(num_heads, device=x.device) // (num_heads // num_groups)

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(compute_dtype)

    delta = f(dt) + (f(dt_bias) if dt_bias is not None else 0.0)
    if dt_softplus:
        delta = F.softplus(delta)
    delta = delta.clamp_min(dt_min)
    if dt_max < NO_UPPER_DT_LIMIT:
        delta = delta.clamp_max(dt_max)

    bounds = cu_seqlens.tolist()
    num_seqs = len(bounds) - 1
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=compute_dtype, device=x.device)
    final = torch.empty(num_seqs, num_heads, head_dim, state_dim, dtype=compute_dtype,
                        device=x.device)
    for s in range(num_seqs):
        start, end = bounds[s], bounds[s + 1]
        state = (f(initial_states[s]) if initial_states is not None else
                 torch.zeros(num_heads, head_dim, state_dim, dtype=compute_dtype, device=x.device))
        y[start:end], final[s] = _scan_one(
            f(x[start:end]), delta[start:end], f(A), f(B[start:end]), f(C[start:end]), state,
            head_group, chunk_size)

    if D is not None:
        y = y + f(D)[:, None] * f(x)
    if z is not None:
        y = y * F.silu(f(z))
    # y in x's dtype; the fp64 test mode keeps everything in fp64.
    return y.to(x.dtype if compute_dtype == torch.float32 else compute_dtype), final


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., Q] -> [..., Q, Q]``: ``out[i, j] = a[j+1] + ... + a[i]`` for ``i >= j`` (0 on
    the diagonal), ``-inf`` above it. Summed directly rather than as a difference of cumulative
    sums, which loses digits once the decay exponent is large."""
    q = a.shape[-1]
    strictly_lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, q).masked_fill(~strictly_lower, 0)  # [i, j] = a[i]
    sums = terms.cumsum(dim=-2)
    lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def _scan_one(x, delta, A, B, C, state, head_group, chunk_size):
    """One sequence: ``x [L, Hh, P]``, ``delta [L, Hh]`` (dt'), ``B, C [L, G, N]``, ``state
    [Hh, P, N]``; returns ``y [L, Hh, P]`` (without D and z) and the final state."""
    length = x.shape[0]
    if length == 0:
        return x.new_zeros(x.shape), state
    q = chunk_size
    num_chunks = -(-length // q)
    pad = num_chunks * q - length
    # Padding tokens have dt' = 0 and x = 0: decay 1 and no input, so the state passes through.
    chunked = [F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).unflatten(0, (num_chunks, q))
               for t in (x, delta, B, C)]
    x, delta, B, C = chunked  # [c, q, Hh, P], [c, q, Hh], [c, q, G, N], [c, q, G, N]

    decay_log = (delta * A).transpose(1, 2)  # [c, Hh, q]: log of each token's decay
    decay_from_start = decay_log.cumsum(dim=-1).exp()  # [c, Hh, q]: chunk start -> token i
    segment_decay = _segsum(decay_log).exp()  # [c, Hh, q, q]: token j -> token i (i >= j)

    # Intra-chunk (the quadratic, attention-like form): y_i += sum_{j<=i} (C_i.B_j) L_ij dt'_j x_j.
    # C.B is per group (G = 1 in Mamba2), then broadcast to the group's heads.
    scores = torch.einsum("cign,cjgn->cgij", C, B)[:, head_group]  # [c, Hh, q, q]
    scores = scores * segment_decay * delta.transpose(1, 2)[:, :, None, :]
    y = torch.einsum("chij,cjhp->cihp", scores, x)

    # Each chunk's own contribution to the state at its end: sum_j L_{last,j} dt'_j x_j (x) B_j.
    to_end = segment_decay[:, :, -1, :] * delta.transpose(1, 2)  # [c, Hh, q]
    chunk_states = torch.einsum("chj,cjhp,cjhn->chpn", to_end, x, B[:, :, head_group])

    # Inter-chunk: pass the state across chunk boundaries, sequentially.
    chunk_decay = decay_from_start[:, :, -1]  # [c, Hh]
    states_at_start = []
    for c in range(num_chunks):
        states_at_start.append(state)
        state = chunk_decay[c][:, None, None] * state + chunk_states[c]
    states_at_start = torch.stack(states_at_start)  # [c, Hh, P, N]

    # The state entering each chunk, decayed to token i and read out by C_i.
    y = y + torch.einsum("cihn,chpn,chi->cihp", C[:, :, head_group], states_at_start,
                         decay_from_start)
    return y.flatten(0, 1)[:length], state


class Key(NamedTuple):
    """ssd_scan's dispatch key: what an implementation may decide on (OpSpec.key). The head and
    state dims, chunk size and dt limits are the model's; the token count T and the sequence
    count Bs change per batch and are classes (``size_class``). ``dt_max`` is ``inf`` for "no
    upper limit" (any ``dt_max >= NO_UPPER_DT_LIMIT``), so equal calls share one key."""

    device: torch.device
    x_dtype: torch.dtype  # x's, z's, B's and C's
    dt_dtype: torch.dtype
    num_heads: int
    head_dim: int
    num_groups: int
    state_dim: int
    chunk_size: int
    D_dtype: Optional[torch.dtype]  # None: no D
    dt_bias_dtype: Optional[torch.dtype]  # None: no dt_bias
    dt_softplus: bool
    dt_min: float
    dt_max: float
    num_tokens_class: int
    num_seqs_class: int
    x_layout: Layout
    dt_layout: Layout
    A_layout: Layout
    B_layout: Layout
    C_layout: Layout
    cu_seqlens_layout: Layout
    D_layout: Optional[Layout]
    z_layout: Optional[Layout]  # None: no gate
    dt_bias_layout: Optional[Layout]
    initial_states_layout: Optional[Layout]  # None: zero initial states

    @property
    def has_dt_limit(self) -> bool:
        """Whether the clamp of dt' does anything (dt' >= 0 is a precondition)."""
        return self.dt_min > 0.0 or self.dt_max < math.inf


def validate(
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
    dt_max: float = NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> Key:
    """Check a call against the spec; return the dispatch key. Values are not checked: that
    would sync the device (checked mode's ``check_data`` checks cu_seqlens; A < 0 stays a
    precondition)."""
    check_tensor(NAME, "x", x, dtypes=ACTIVATION_DTYPES, rank=3)
    device = x.device
    num_tokens, num_heads, head_dim = x.shape

    def check_shape(name: str, value: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(value.shape) != shape:
            raise InvalidArgumentError(NAME, name, f"shape {shape} ({what})", tuple(value.shape))

    def check_activation(name: str, value: Any, rank: int) -> None:
        check_tensor(NAME, name, value, dtypes=ACTIVATION_DTYPES, rank=rank, device=device)
        if value.dtype != x.dtype:
            raise InvalidArgumentError(NAME, name, f"x's dtype {x.dtype}", value.dtype)

    check_tensor(NAME, "dt", dt, dtypes=PARAM_DTYPES, rank=2, device=device)
    check_shape("dt", dt, (num_tokens, num_heads), "[T, Hh] from x")
    check_tensor(NAME, "A", A, dtypes=(torch.float32,), rank=1, device=device)
    check_shape("A", A, (num_heads,), "[Hh] from x")
    check_activation("B", B, 3)
    num_groups, state_dim = B.shape[1], B.shape[2]
    if B.shape[0] != num_tokens:
        raise InvalidArgumentError(NAME, "B", f"{num_tokens} tokens (x's T) in dim 0",
                                   tuple(B.shape))
    if num_groups == 0 or num_heads % num_groups:
        raise InvalidArgumentError(
            NAME, "B", f"a group count G = B.shape[1] dividing the head count Hh = {num_heads}",
            num_groups)
    check_activation("C", C, 3)
    check_shape("C", C, tuple(B.shape), "B's [T, G, N]")
    check_tensor(NAME, "cu_seqlens", cu_seqlens, dtypes=(torch.int32,), rank=1, device=device)
    if cu_seqlens.shape[0] < 1:
        raise InvalidArgumentError(NAME, "cu_seqlens", "[Bs + 1] offsets (at least [0])",
                                   tuple(cu_seqlens.shape))
    num_seqs = cu_seqlens.shape[0] - 1
    for name, value in (("D", D), ("dt_bias", dt_bias)):
        if value is not None:
            check_tensor(NAME, name, value, dtypes=PARAM_DTYPES, rank=1, device=device)
            check_shape(name, value, (num_heads,), "[Hh] from x")
    if z is not None:
        check_activation("z", z, 3)
        check_shape("z", z, tuple(x.shape), "x's [T, Hh, P]")
    if type(dt_softplus) is not bool:
        raise InvalidArgumentError(NAME, "dt_softplus", "a bool", type(dt_softplus).__name__)
    for name, value in (("dt_min", dt_min), ("dt_max", dt_max)):
        if type(value) not in (float, int):
            raise InvalidArgumentError(NAME, name, "a Python float", type(value).__name__)
    if not 0.0 <= dt_min <= dt_max:  # also rejects NaN (which would make a key never equal)
        raise InvalidArgumentError(NAME, "dt_max" if dt_min >= 0 else "dt_min",
                                   "0 <= dt_min <= dt_max", f"dt_min={dt_min}, dt_max={dt_max}")
    if initial_states is not None:
        check_tensor(NAME, "initial_states", initial_states, dtypes=(torch.float32,), rank=4,
                     device=device)
        check_shape("initial_states", initial_states, (num_seqs, num_heads, head_dim, state_dim),
                    "[Bs, Hh, P, N] with Bs = len(cu_seqlens) - 1")
    check_int(NAME, "chunk_size", chunk_size, low=1)
    if chunk_size & (chunk_size - 1):
        raise InvalidArgumentError(NAME, "chunk_size", "a power of two", chunk_size)
    return Key(
        device, x.dtype, dt.dtype, num_heads, head_dim, num_groups, state_dim, chunk_size,
        D.dtype if D is not None else None, dt_bias.dtype if dt_bias is not None else None,
        dt_softplus, dt_min, math.inf if dt_max >= NO_UPPER_DT_LIMIT else dt_max,
        size_class(num_tokens), size_class(num_seqs), layout(x), layout(dt), layout(A), layout(B),
        layout(C), layout(cu_seqlens), layout(D), layout(z), layout(dt_bias),
        layout(initial_states),
    )


def check_data(
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
    dt_max: float = NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> None:
    """Checked mode: cu_seqlens starts at 0, never decreases and ends at T = x.shape[0]."""
    enforce(NAME, offsets_rules("cu_seqlens", cu_seqlens, x.shape[0], "T (x.shape[0])"))


def fake(
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
    dt_max: float = NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs = cu_seqlens.shape[0] - 1
    num_heads, head_dim = x.shape[1], x.shape[2]
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty((num_seqs, num_heads, head_dim, B.shape[2]), dtype=torch.float32,
                    device=x.device),
    )


# Keyed by x's dtype, for both outputs (fast kernels round intermediates to x's dtype too).
# Cases are scaled so |y| and |state| are O(1), which makes the atol meaningful.
# - fp32: the reference is fp32 too; implementations differ in summation order and chunking. Fp32
#   dots must be fp32-accurate: one TF32 pass (Triton's tl.dot default, 10-bit mantissa) was off by
#   up to 8e-3 on Mamba2-2.7B on an H200, so the triton backend multiplies fp32 at 3xTF32.
# - bf16: y is rounded to bf16 (2^-9 relative), and mamba_ssm-style kernels also round the decayed
#   C.B matrix and the decayed B to bf16 before their dots: a few bf16 ulps, so ~2^-6.
# - fp16: the same with fp16's 2^-11 rounding.
TOLERANCE = {
    torch.float32: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3),
}


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Both outputs elementwise, with the tolerance of x's dtype."""
    tolerance = TOLERANCE[kwargs["x"].dtype]
    for got, want, what in zip(actual, expected, ("y", "final_states")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
        assert_close(got, want, tolerance, f"{NAME} {what}")


def _chunk_pairs(length: int, chunk_size: int) -> tuple[int, int]:
    """(causal token pairs inside chunks, chunk count) of one sequence."""
    full, rest = divmod(length, chunk_size)
    pairs = full * chunk_size * (chunk_size + 1) // 2 + rest * (rest + 1) // 2
    return pairs, full + (rest > 0)


def cost(kwargs: Mapping[str, Any]) -> Cost:
    x, B = kwargs["x"], kwargs["B"]
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    lengths = kwargs["cu_seqlens"].diff().tolist()  # host-side: cost is for the roofline only
    pairs, chunks = 0, 0
    for length in lengths:
        p, c = _chunk_pairs(length, kwargs["chunk_size"])
        pairs, chunks = pairs + p, chunks + c
    # The chunked SSD work (what fast kernels do): C.B per group over causal pairs, the
    # intra-chunk product, chunk states, the off-chunk read-out and the state passing; the
    # elementwise terms (decays, D, gate) are lower order.
    flops = (
        2 * pairs * num_groups * state_dim
        + 2 * pairs * num_heads * head_dim
        + 2 * 2 * num_tokens * num_heads * head_dim * state_dim
        + 2 * chunks * num_heads * head_dim * state_dim
    )
    inputs = [kwargs[name] for name in ("x", "dt", "A", "B", "C", "cu_seqlens", "D", "z",
                                        "dt_bias", "initial_states")]
    bytes_moved = sum(t.numel() * t.element_size() for t in inputs if t is not None)
    bytes_moved += x.numel() * x.element_size()  # y
    bytes_moved += len(lengths) * num_heads * head_dim * state_dim * 4  # final_states
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases. Values follow Mamba2's parameterization so decays and step sizes are realistic:
# A = -exp(A_log) with A in [-16, -1], dt_bias = softplus^-1 of a step in [1e-3, 1e-1], raw dt
# around 0; B and C are scaled by N^-1/2 so |y| stays O(1) whatever N.


def _maker(
    lengths: tuple[int, ...],
    heads: int,
    head_dim: int,
    groups: int,
    state_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    chunk_size: int = 256,
    with_d: bool = True,
    with_z: bool = True,
    with_dt_bias: bool = True,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, NO_UPPER_DT_LIMIT),
    with_initial_states: bool = True,
    param_dtype: torch.dtype = torch.float32,
    dt_shift: float = 0.0,  # added to the typical step that dt_bias encodes
):
    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator)

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=generator)

        tokens = sum(lengths)
        cu_seqlens = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        if dt_softplus:
            dt = randn(tokens, heads) * 0.5
        else:  # without softplus dt' must already be a (positive) step
            dt = rand(tokens, heads) * 0.1
        step = torch.exp(math.log(1e-3) + rand(heads) * math.log(100.0)) + dt_shift  # 1e-3..0.1
        dt_bias = (step + torch.log(-torch.expm1(-step))) if dt_softplus else rand(heads) * 0.01
        scale = state_dim ** -0.5
        kwargs = {
            "x": randn(tokens, heads, head_dim).to(dtype),
            "dt": dt.to(dtype),
            "A": -torch.exp(rand(heads) * math.log(16.0)),
            "B": (randn(tokens, groups, state_dim) * scale).to(dtype),
            "C": (randn(tokens, groups, state_dim) * scale).to(dtype),
            "cu_seqlens": cu_seqlens,
            "D": (1 + 0.1 * randn(heads)).to(param_dtype) if with_d else None,
            "z": randn(tokens, heads, head_dim).to(dtype) if with_z else None,
            "dt_bias": dt_bias.to(param_dtype) if with_dt_bias else None,
            "dt_softplus": dt_softplus,
            "dt_min": dt_limit[0],
            "dt_max": dt_limit[1],
            "initial_states": (randn(len(lengths), heads, head_dim, state_dim)
                               if with_initial_states else None),
            "chunk_size": chunk_size,
        }
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _mamba2_2p7b(lengths: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, **options: Any):
    # Mamba2-2.7B: d_inner 5120 = 80 heads of 64, d_state 128, one group, chunk 256, softplus dt.
    return _maker(lengths, 80, 64, 1, 128, dtype, 256, **options)


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    return (
        Case("mamba2_2.7b_t128", _mamba2_2p7b((128,), with_initial_states=False), quick,
             "Mamba2-2.7B prefill of one 128-token prompt from an empty state (half a chunk)"),
        Case("mamba2_2.7b_t1024", _mamba2_2p7b((1024,), with_initial_states=False), model,
             "Mamba2-2.7B prefill of one 1024-token prompt: four full chunks"),
        Case("mamba2_2.7b_t1024_varlen", _mamba2_2p7b((17, 300, 512, 195)), model,
             "Mamba2-2.7B mixed prefill batch (chunked-prefill continuation, so initial states): "
             "lengths below, above and at multiples of the chunk"),
        Case("mamba2_2.7b_fp32_t256", _mamba2_2p7b((256,), torch.float32), quick,
             "Mamba2-2.7B with fp32 activations: exactly one chunk"),
        Case("small_varlen", _maker((5, 16, 1, 23), 4, 8, 2, 16, torch.float32, 8), random,
             "chunk 8: sequences shorter than, equal to and longer than a chunk; G = 2"),
        Case("small_bf16_limits", _maker((9, 3), 6, 4, 3, 8, torch.bfloat16, 4,
                                         dt_limit=(0.01, 0.05)), random,
             "bf16 with an active dt clamp on both sides; Hh / G = 2, G = 3 (not a power of two)"),
        Case("small_fp16_params", _maker((12,), 4, 4, 4, 8, torch.float16, 4,
                                              param_dtype=torch.float16), random,
             "fp16 activations and fp16 D / dt_bias; G = Hh (one group per head)"),
        Case("no_options", _maker((7, 10), 2, 4, 1, 4, torch.float32, 4, with_d=False,
                                  with_z=False, with_dt_bias=False, dt_softplus=False,
                                  with_initial_states=False), edge,
             "every optional off: no D, z, dt_bias, softplus or initial state"),
        Case("empty", _maker((), 4, 8, 1, 16, torch.bfloat16, 8), edge,
             "no sequences (T = 0, cu_seqlens = [0]): empty outputs, not a failure"),
        Case("empty_sequence", _maker((6, 0, 9), 4, 8, 1, 16, torch.float32, 8), edge,
             "a zero-length sequence inside the batch: its final state is its initial state"),
        Case("one_token", _maker((1,), 4, 8, 2, 16, torch.bfloat16, 256), edge,
             "T = 1 against chunk 256: a chunk that is almost all padding"),
        Case("chunk_size_1", _maker((5, 3), 2, 4, 1, 8, torch.float32, 1), edge,
             "Q = 1: the chunked form degenerates to the plain recurrence"),
        Case("strong_decay", _maker((40,), 2, 4, 1, 8, torch.float32, 16,
                                    dt_limit=(0.0, 100.0), dt_shift=5.0), edge,
             "dt' ~ 5 with A down to -16: decays of exp(-80) per token, the decay exponent "
             "reaches ~-1e3 inside a chunk (underflow must give 0, not NaN)"),
    )



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn prefill batches: 0-4 sequences of 0-40 tokens (empty ones too) against chunks of 1-16,
    1-3 groups of 1-3 heads, head and state dims from 1 to 16, every optional input on or off, a dt
    clamp or none, fp32/bf16/fp16 activations and D / dt_bias."""
    lengths = tuple(draw(st.lists(st.integers(0, 40), max_size=4)))
    groups = draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 3))
    head_dim, state_dim = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 8, 16]))
    chunk = draw(st.sampled_from([1, 2, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    param_dtype = draw(st.sampled_from([torch.float32, dtype]))
    flags = {name: draw(st.booleans()) for name in
             ("with_d", "with_z", "with_dt_bias", "dt_softplus", "with_initial_states")}
    limit = draw(st.sampled_from([(0.0, NO_UPPER_DT_LIMIT), (0.01, 0.05), (0.0, 0.02)]))
    return drawn(f"lengths {lengths}, chunk {chunk}, {heads} heads in {groups} groups, P {head_dim}, "
                 f"N {state_dim}, {str(dtype)[6:]} ({str(param_dtype)[6:]} params), dt limit {limit}, "
                 + ", ".join(f"{k} {v}" for k, v in flags.items()),
                 _maker(lengths, heads, head_dim, groups, state_dim, dtype, chunk, dt_limit=limit,
                        param_dtype=param_dtype, **flags))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=ssd_scan,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    check_data=check_data,
    shapes=_shapes,
)
