"""selective_state_update: one Mamba2 decode step, updating each request's SSM state in its cache
slot in place; the spec, its reference and its cases."""

import math
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import distinct_rule, enforce, index_rule
from kernelmux.specs._compare import assert_close
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "selective_state_update"]

NAME = "selective_state_update"
STATE_DTYPES = (torch.float32, torch.bfloat16)
# x, z, B and C are the layer's activations and share one dtype; y comes back in it.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = ACTIVATION_DTYPES  # dt, D, dt_bias: upcast exactly


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
    """Advance each request's SSM state by one token, in place, and read out its output.

    For request ``b`` with cache slot ``s`` and head ``h`` (group ``g = h // (Hh / G)``), in fp32:
    ``dt' = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias``,
    ``new = exp(dt' * A) * state[s] + dt' * outer(x_b, B_b)`` (``[P, N]``),
    ``y_b = new @ C_b + D * x_b``, then ``y_b *= silu(z_b)`` when ``z`` is given; ``state[s]``
    is overwritten with ``new`` rounded to the state's dtype (y is read from the fp32 ``new``).
    This is one step of ``ssd_scan``'s recurrence (with its default dt limits).

    Args:
        state: ``[S, Hh, P, N]`` fp32/bf16, the SSM state cache; updated in place, only in the
            slots of non-padding requests.
        x: ``[Bs, Hh, P]`` fp32/bf16/fp16, this step's token per request.
        dt: ``[Bs, Hh]`` fp32/bf16/fp16, the raw time step. Precondition (unchecked): ``dt' >= 0``.
        A: ``[Hh]`` fp32, negative. Not checked (a value check would sync the device).
        B: ``[Bs, G, N]``, x's dtype; ``Hh % G == 0``.
        C: ``[Bs, G, N]``, x's dtype.
        D: ``[Hh]`` or None (no skip connection).
        z: ``[Bs, Hh, P]`` x's dtype, or None (no gate).
        dt_bias: ``[Hh]`` or None (zero).
        dt_softplus: apply softplus to ``dt + dt_bias``.
        state_batch_indices: ``[Bs]`` int32 on x's device, request ``b``'s slot in ``state``, or
            None (then ``S == Bs`` and request ``b`` uses slot ``b``). A negative entry marks a
            padding request (CUDA-graph batches): its slot is not read or written and its row of
            ``y`` is zero. Non-negative entries must be distinct and ``< S`` (unchecked: values).

    Returns:
        ``y [Bs, Hh, P]`` in x's dtype.
    """
    num_requests, num_heads, _ = x.shape
    num_groups = B.shape[1]
    head_group = torch.arange(num_heads, device=x.device) // (num_heads // num_groups)
    # The reference may sync; implementations must not.
    slots = range(num_requests) if state_batch_indices is None else state_batch_indices.tolist()
    y = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    # One request at a time, on tensors whose shapes do not depend on the batch, so a request's
    # row is a function of its own inputs: batched, torch's CPU kernels computed an element in a
    # vector loop or in a scalar tail loop by its position in the tensor (softplus and silu differ
    # there by an ulp; an EPYC host gave a request other bits in a reordered batch), and GPU
    # reductions pick their split by the tensor's shape.
    for request, slot in enumerate(slots):
        if slot < 0:
            continue  # padding: its slot is neither read nor written, its row of y stays zero
        delta = dt[request].float() + (dt_bias.float() if dt_bias is not None else 0.0)  # [Hh]
        if dt_softplus:
            delta = F.softplus(delta)
        decay = torch.exp(delta * A.float())[:, None, None]
        x_request = x[request].float()  # [Hh, P]
        B_request = B[request].float()[head_group]  # [Hh, N]
        C_request = C[request].float()[head_group]
        update = (delta[:, None] * x_request)[..., None] * B_request[:, None]  # dt' x (x) B
        new = decay * state[slot].float() + update  # [Hh, P, N]
        y_request = (new * C_request[:, None, :]).sum(dim=-1)  # [Hh, P]
        if D is not None:
            y_request = y_request + D.float()[:, None] * x_request
        if z is not None:
            y_request = y_request * F.silu(z[request].float())
        state[slot] = new.to(state.dtype)
        y[request] = y_request.to(x.dtype)
    return y


class Key(NamedTuple):
    """selective_state_update's dispatch key: what an implementation may decide on (OpSpec.key).
    The head and state dims are the model's; the request count Bs changes per batch and the
    cache's slot count S is a class as well (``size_class``): it equals Bs when there are no
    indices, and a class still bounds the state's size (e.g. for 32-bit offsets)."""

    device: torch.device
    state_dtype: torch.dtype
    x_dtype: torch.dtype  # x's, z's, B's and C's
    dt_dtype: torch.dtype
    num_heads: int
    head_dim: int
    num_groups: int
    state_dim: int
    D_dtype: Optional[torch.dtype]  # None: no D
    dt_bias_dtype: Optional[torch.dtype]  # None: no dt_bias
    dt_softplus: bool
    num_requests_class: int
    num_slots_class: int
    state_layout: Layout
    x_layout: Layout
    dt_layout: Layout
    A_layout: Layout
    B_layout: Layout
    C_layout: Layout
    D_layout: Optional[Layout]
    z_layout: Optional[Layout]  # None: no gate
    dt_bias_layout: Optional[Layout]
    state_batch_indices_layout: Optional[Layout]  # None: request b uses slot b


def validate(
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
) -> Key:
    """Check a call against the spec; return the dispatch key. Values are not checked: that
    would sync the device (checked mode's ``check_data`` checks the slot indices; A < 0 stays a
    precondition)."""
    check_tensor(NAME, "x", x, dtypes=ACTIVATION_DTYPES, rank=3)
    device = x.device
    num_requests, num_heads, head_dim = x.shape

    def check_shape(name: str, value: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(value.shape) != shape:
            raise InvalidArgumentError(NAME, name, f"shape {shape} ({what})", tuple(value.shape))

    def check_activation(name: str, value: Any) -> None:
        check_tensor(NAME, name, value, dtypes=ACTIVATION_DTYPES, rank=3, device=device)
        if value.dtype != x.dtype:
            raise InvalidArgumentError(NAME, name, f"x's dtype {x.dtype}", value.dtype)

    check_tensor(NAME, "state", state, dtypes=STATE_DTYPES, rank=4, device=device)
    num_slots, state_heads, state_head_dim, state_dim = state.shape
    if (state_heads, state_head_dim) != (num_heads, head_dim):
        raise InvalidArgumentError(NAME, "state", f"shape (S, {num_heads}, {head_dim}, N) "
                                   "([S, Hh, P, N] with x's Hh and P)", tuple(state.shape))
    check_tensor(NAME, "dt", dt, dtypes=PARAM_DTYPES, rank=2, device=device)
    check_shape("dt", dt, (num_requests, num_heads), "[Bs, Hh] from x")
    check_tensor(NAME, "A", A, dtypes=(torch.float32,), rank=1, device=device)
    check_shape("A", A, (num_heads,), "[Hh] from x")
    check_activation("B", B)
    num_groups = B.shape[1]
    check_shape("B", B, (num_requests, num_groups, state_dim), "[Bs, G, N] with x's Bs, state's N")
    if num_groups == 0 or num_heads % num_groups:
        raise InvalidArgumentError(
            NAME, "B", f"a group count G = B.shape[1] dividing the head count Hh = {num_heads}",
            num_groups)
    check_activation("C", C)
    check_shape("C", C, tuple(B.shape), "B's [Bs, G, N]")
    for name, value in (("D", D), ("dt_bias", dt_bias)):
        if value is not None:
            check_tensor(NAME, name, value, dtypes=PARAM_DTYPES, rank=1, device=device)
            check_shape(name, value, (num_heads,), "[Hh] from x")
    if z is not None:
        check_activation("z", z)
        check_shape("z", z, tuple(x.shape), "x's [Bs, Hh, P]")
    if type(dt_softplus) is not bool:
        raise InvalidArgumentError(NAME, "dt_softplus", "a bool", type(dt_softplus).__name__)
    if state_batch_indices is not None:
        check_tensor(NAME, "state_batch_indices", state_batch_indices, dtypes=(torch.int32,),
                     rank=1, device=device)
        check_shape("state_batch_indices", state_batch_indices, (num_requests,),
                    "one slot per request of x")
    elif num_slots != num_requests:
        raise InvalidArgumentError(
            NAME, "state", f"{num_requests} slots (one per request) when state_batch_indices is "
            "None", num_slots, hint="pass state_batch_indices to address a larger cache")
    return Key(
        device, state.dtype, x.dtype, dt.dtype, num_heads, head_dim, num_groups, state_dim,
        D.dtype if D is not None else None, dt_bias.dtype if dt_bias is not None else None,
        dt_softplus, size_class(num_requests), size_class(num_slots), layout(state), layout(x),
        layout(dt), layout(A), layout(B), layout(C), layout(D), layout(z), layout(dt_bias),
        layout(state_batch_indices),
    )


def check_data(
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
) -> None:
    """Checked mode: every request's slot inside the cache (negative slots are padding), and no
    slot shared by two live requests (both would write it)."""
    if state_batch_indices is None:
        return  # request b uses slot b, and validate saw S == Bs
    num_slots = state.shape[0]
    enforce(NAME, [
        index_rule("state_batch_indices", state_batch_indices, num_slots,
                   f"the cache's {num_slots} slots, state.shape[0]", negative_skips=True),
        distinct_rule("state_batch_indices", state_batch_indices,
                      "two requests would update one slot", negative_skips=True),
    ])


def fake(
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
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# Keyed by dtype: y uses x's, the updated state uses the state's. One step is elementwise work and
# one N-term dot per output, all in fp32, so implementations differ only by exp/softplus ulps and
# summation order (fp32 row); the bf16 and fp16 rows are one rounding of the result (2^-9 and
# 2^-11 relative) that a few-ulp fp32 difference can push to the neighbouring value, doubled.
TOLERANCE = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so untouched slots compare exactly (NaN sentinels included)."""
    return t.detach().cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """``(y, state)``: y and the written slots within tolerance; padding rows of y exactly zero and
    every slot no live request owns bit-identical to the expected (untouched) one."""
    (y, state), (ref_y, ref_state) = actual, expected
    for got, want, what in ((y, ref_y, "y"), (state, ref_state, "state")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
    indices = kwargs["state_batch_indices"]
    slots = (torch.arange(y.shape[0]) if indices is None else indices.long().cpu())
    live = slots >= 0
    written = torch.zeros(state.shape[0], dtype=torch.bool)
    written[slots[live]] = True

    padding_rows = (~live).nonzero().flatten()
    if padding_rows.numel() and bool(y.cpu()[padding_rows].ne(0).any()):
        raise AssertionError(f"{NAME} y: padding rows {padding_rows.tolist()} are not all zero")
    untouched = (~written).nonzero().flatten()
    changed = (_bits(state)[untouched] != _bits(ref_state)[untouched]).flatten(1).any(1)
    if bool(changed.any()):
        raise AssertionError(
            f"{NAME} state: slots {untouched[changed].tolist()} belong to no live request but "
            "were modified")
    assert_close(y.cpu()[live], ref_y.cpu()[live], TOLERANCE[y.dtype], f"{NAME} y (live rows)")
    assert_close(state.cpu()[written], ref_state.cpu()[written], TOLERANCE[state.dtype],
                 f"{NAME} state (written slots)")


def cost(kwargs: Mapping[str, Any]) -> Cost:
    state, x = kwargs["state"], kwargs["x"]
    indices = kwargs["state_batch_indices"]
    _, num_heads, head_dim, state_dim = state.shape
    # Host-side (cost is for the roofline only): padding requests do no work.
    live = x.shape[0] if indices is None else int((indices >= 0).sum())
    state_elements = live * num_heads * head_dim * state_dim
    # Per state element: decay, dt*x*B (2), add, times C and the sum into y.
    flops = 6 * state_elements
    inputs = [kwargs[name] for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                        "state_batch_indices")]
    bytes_moved = sum(t.numel() * t.element_size() for t in inputs if t is not None)
    bytes_moved += 2 * state_elements * state.element_size() + x.numel() * x.element_size()
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases: Mamba2's parameterization as in ssd_scan's cases. The cache holds more slots than
# requests, requests map to a random subset in random order, and slots no request owns are
# filled with NaN so that any read of them or write to them shows.


def _maker(
    requests: int,
    heads: int,
    head_dim: int,
    groups: int,
    state_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
    slots: Optional[int] = None,
    padding: int = 0,
    with_d: bool = True,
    with_z: bool = True,
    with_dt_bias: bool = True,
    dt_softplus: bool = True,
    param_dtype: torch.dtype = torch.float32,
):
    """``slots=None``: no indices, S = requests. Else ``padding`` of the requests get index -1."""

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator)

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=generator)

        num_slots = requests if slots is None else slots
        state = randn(num_slots, heads, head_dim, state_dim).to(state_dtype)
        indices = None
        if slots is not None:
            chosen = torch.randperm(num_slots, generator=generator)[:requests]
            chosen[torch.randperm(requests, generator=generator)[:padding]] = -1
            owned = torch.zeros(num_slots, dtype=torch.bool)
            owned[chosen[chosen >= 0]] = True
            state[~owned] = float("nan")
            indices = chosen.to(torch.int32)
        if dt_softplus:
            dt = randn(requests, heads) * 0.5
        else:  # without softplus dt' must already be a (positive) step
            dt = rand(requests, heads) * 0.1
        step = torch.exp(math.log(1e-3) + rand(heads) * math.log(100.0))  # 1e-3..0.1
        dt_bias = (step + torch.log(-torch.expm1(-step))) if dt_softplus else rand(heads) * 0.01
        scale = state_dim ** -0.5
        kwargs = {
            "state": state,
            "x": randn(requests, heads, head_dim).to(dtype),
            "dt": dt.to(dtype),
            "A": -torch.exp(rand(heads) * math.log(16.0)),
            "B": (randn(requests, groups, state_dim) * scale).to(dtype),
            "C": (randn(requests, groups, state_dim) * scale).to(dtype),
            "D": (1 + 0.1 * randn(heads)).to(param_dtype) if with_d else None,
            "z": randn(requests, heads, head_dim).to(dtype) if with_z else None,
            "dt_bias": dt_bias.to(param_dtype) if with_dt_bias else None,
            "dt_softplus": dt_softplus,
            "state_batch_indices": indices,
        }
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _mamba2_2p7b(requests: int, **options: Any):
    # Mamba2-2.7B: 80 heads of 64, d_state 128, one group; bf16 activations, a cache of a few more
    # slots than requests (S = Bs + 8, 2.6 MB per fp32 slot) addressed by index.
    options.setdefault("slots", requests + 8)
    return _maker(requests, 80, 64, 1, 128, **options)


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    random, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    return (
        Case("mamba2_2.7b_b1", _mamba2_2p7b(1), quick, "Mamba2-2.7B decode of one request"),
        Case("mamba2_2.7b_b8", _mamba2_2p7b(8), quick, "Mamba2-2.7B decode at batch 8"),
        Case("mamba2_2.7b_b64", _mamba2_2p7b(64), model, "Mamba2-2.7B decode at batch 64"),
        Case("mamba2_2.7b_b64_padded", _mamba2_2p7b(64, padding=5), model,
             "Mamba2-2.7B batch 64 as a CUDA-graph bucket holding 59 live requests"),
        Case("mamba2_2.7b_b8_bf16_state", _mamba2_2p7b(8, state_dtype=torch.bfloat16), quick,
             "Mamba2-2.7B with a bf16 state cache (engines that halve the cache)"),
        Case("small_permuted", _maker(5, 4, 8, 2, 16, torch.float32, slots=9), random,
             "requests in a random subset of a larger cache, in random order; G = 2"),
        Case("small_padded_bf16", _maker(6, 6, 4, 3, 8, torch.bfloat16, torch.bfloat16, slots=8,
                                         padding=2), random,
             "bf16 state and activations, two padding requests; G = 3 (not a power of two)"),
        Case("small_fp16_params", _maker(3, 4, 4, 4, 8, torch.float16, slots=5,
                                         param_dtype=torch.float16), random,
             "fp16 activations and fp16 D / dt_bias; G = Hh (one group per head)"),
        Case("no_indices", _maker(4, 4, 8, 1, 16, torch.float32), random,
             "state_batch_indices None: request b uses slot b of a cache of exactly Bs slots"),
        Case("no_options", _maker(3, 2, 4, 1, 4, torch.float32, slots=4, with_d=False,
                                  with_z=False, with_dt_bias=False, dt_softplus=False), edge,
             "every optional off: no D, z, dt_bias or softplus"),
        Case("all_padding", _maker(4, 4, 8, 1, 16, torch.bfloat16, slots=6, padding=4), edge,
             "every request is padding: y is all zero and the cache is untouched"),
        Case("empty", _maker(0, 4, 8, 1, 16, torch.bfloat16, slots=3), edge,
             "Bs = 0: an empty batch returns an empty y and touches nothing"),
    )



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn decode steps: 0-8 requests, 1-4 heads per group in 1-2 groups, head and state dims
    from tiny to Mamba2's 64/128, slot indices with padding, each optional input on or off."""
    requests = draw(st.integers(0, 8))
    groups = draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 3, 16, 64]))
    state_dim = draw(st.sampled_from([2, 16, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    state_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    indexed = draw(st.booleans())
    slots = requests + draw(st.integers(0, 4)) if indexed else None
    padding = draw(st.integers(0, requests)) if indexed else 0
    flags = {name: draw(st.booleans()) for name in ("with_d", "with_z", "with_dt_bias", "dt_softplus")}
    return drawn(f"B {requests}, {heads} heads in {groups} groups, P {head_dim}, N {state_dim}, {str(dtype)[6:]}, "
                 f"{str(state_dtype)[6:]} state, slots {slots} ({padding} padding), "
                 + ", ".join(f"{k} {v}" for k, v in flags.items()),
                 _maker(requests, heads, head_dim, groups, state_dim, dtype, state_dtype, slots, padding,
                        **flags))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=selective_state_update,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    check_data=check_data,
    mutates_args=("state",),
    shapes=_shapes,
)
