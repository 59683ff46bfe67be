"""The ssd_scan spec: its chunked reference against a step-by-step recurrence, its validation,
fake, cases and cost."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelmux.errors import DeviceDataError, InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import ssd_scan as spec_module
from kernelmux.specs.ssd_scan import NO_UPPER_DT_LIMIT, SPEC

reference = SPEC.reference


def recurrence(x, dt, A, B, C, cu_seqlens, D=None, z=None, dt_bias=None, dt_softplus=False,
               dt_min=0.0, dt_max=NO_UPPER_DT_LIMIT, initial_states=None, chunk_size=256):
    """The op's definition, one token at a time in fp64 (chunk_size is irrelevant to it)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    num_tokens, num_heads, head_dim = x.shape
    groups, state_dim = B.shape[1:]
    per_group = num_heads // groups
    bounds = cu_seqlens.tolist()
    y = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    finals = []
    for s in range(len(bounds) - 1):
        state = (initial_states[s].double().clone() if initial_states is not None
                 else torch.zeros(num_heads, head_dim, state_dim, dtype=torch.float64))
        for t in range(bounds[s], bounds[s + 1]):
            for h in range(num_heads):
                step = dt[t, h] + (dt_bias[h].double() if dt_bias is not None else 0.0)
                if dt_softplus:
                    step = F.softplus(step)
                step = step.clamp_min(dt_min)
                if dt_max < NO_UPPER_DT_LIMIT:
                    step = step.clamp_max(dt_max)
                g = h // per_group
                state[h] = torch.exp(step * A[h]) * state[h] + step * torch.outer(x[t, h], B[t, g])
                out = state[h] @ C[t, g]
                if D is not None:
                    out = out + D[h].double() * x[t, h]
                if z is not None:
                    out = out * F.silu(z[t, h].double())
                y[t, h] = out
        finals.append(state)
    final = (torch.stack(finals) if finals
             else torch.zeros(0, num_heads, head_dim, state_dim, dtype=torch.float64))
    return y, final


def _chunked_fp64(kwargs):
    return spec_module._ssd_scan(*(kwargs[n] for n in SPEC.signature.parameters), torch.float64)


def _small(lengths, chunk_size, heads=4, head_dim=3, groups=2, state_dim=5, **options):
    make = spec_module._maker(tuple(lengths), heads, head_dim, groups, state_dim, torch.float32,
                              chunk_size, **options)
    return make


# Sequence lengths around a chunk of 8: shorter, equal, one over, two chunks, not a multiple,
# a single token and an empty sequence, all in one packed batch.
_AROUND_A_CHUNK = (7, 8, 9, 16, 29, 1, 0)


@pytest.mark.parametrize("chunk_size", [1, 2, 8, 16, 64])
def test_chunked_form_equals_the_recurrence_in_fp64(chunk_size):
    kwargs = _small(_AROUND_A_CHUNK, chunk_size, dt_limit=(0.02, 0.2))(
        torch.device("cpu"), torch.Generator().manual_seed(chunk_size))
    y, final = _chunked_fp64(kwargs)
    want_y, want_final = recurrence(**kwargs)
    # Exact arithmetic would agree exactly; fp64 rounding over ~30-term sums stays near 1e-15.
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 21), min_size=0, max_size=3),
    chunk_log2=st.integers(0, 5),
    heads_per_group=st.integers(1, 3),
    groups=st.integers(1, 2),
    head_dim=st.integers(1, 3),
    state_dim=st.integers(1, 4),
    with_d=st.booleans(),
    with_z=st.booleans(),
    with_dt_bias=st.booleans(),
    dt_softplus=st.booleans(),
    with_initial_states=st.booleans(),
    dt_limit=st.sampled_from([(0.0, NO_UPPER_DT_LIMIT), (0.0, math.inf), (0.03, 0.08),
                              (0.05, NO_UPPER_DT_LIMIT), (0.0, 0.01)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_the_recurrence(lengths, chunk_log2, heads_per_group, groups, head_dim,
                                          state_dim, with_d, with_z, with_dt_bias, dt_softplus,
                                          with_initial_states, dt_limit, seed):
    make = spec_module._maker(tuple(lengths), heads_per_group * groups, head_dim, groups,
                              state_dim, torch.float32, 2**chunk_log2, with_d=with_d,
                              with_z=with_z, with_dt_bias=with_dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, with_initial_states=with_initial_states)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    SPEC.validate(**kwargs)
    want_y, want_final = recurrence(**kwargs)
    y, final = _chunked_fp64(kwargs)
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)
    # The fp32 reference itself: the same within fp32 rounding.
    y32, final32 = reference(**kwargs)
    assert (y32.dtype, final32.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(y32.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final32.double(), want_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [c for c in SPEC.cases if "model" not in c.tags],
                         ids=lambda c: c.name)
def test_small_cases_conform_to_the_recurrence(case):
    kwargs = case.build(seed=7)
    want_y, want_final = recurrence(**kwargs)
    # The fp64 truth rounded to the output dtype must pass the op's own check_close.
    SPEC.check_close((want_y.to(kwargs["x"].dtype), want_final.float()), reference(**kwargs),
                     kwargs)


def test_model_case_conforms_to_the_recurrence():
    kwargs = SPEC.case("mamba2_2.7b_t1024_varlen").build(seed=2)
    cut = 2  # two sequences (17 and 300 tokens) keep the Python loop oracle quick
    bound = int(kwargs["cu_seqlens"][cut])
    part = dict(kwargs, cu_seqlens=kwargs["cu_seqlens"][:cut + 1],
                initial_states=kwargs["initial_states"][:cut],
                **{n: kwargs[n][:bound] for n in ("x", "dt", "B", "C", "z")})
    vectorized = _vectorized_recurrence(**part)
    SPEC.check_close((vectorized[0].to(torch.bfloat16), vectorized[1].float()), reference(**part),
                     part)


def _vectorized_recurrence(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min,
                           dt_max, initial_states, chunk_size):
    """recurrence() with heads vectorized, for model shapes (same fp64 definition)."""
    heads = x.shape[1]
    head_group = torch.arange(heads) // (heads // B.shape[1])
    step = dt.double() + dt_bias.double()
    step = (F.softplus(step) if dt_softplus else step).clamp_min(dt_min)
    y = torch.zeros(x.shape, dtype=torch.float64)
    finals = []
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        state = initial_states[s].double()
        for t in range(bounds[s], bounds[s + 1]):
            state = (torch.exp(step[t] * A.double())[:, None, None] * state
                     + (step[t][:, None] * x[t].double())[..., None]
                     * B[t].double()[head_group][:, None, :])
            y[t] = state @ C[t].double()[0] if B.shape[1] == 1 else \
                (state * C[t].double()[head_group][:, None, :]).sum(-1)
        finals.append(state)
    y = (y + D.double()[:, None] * x.double()) * F.silu(z.double())
    return y, torch.stack(finals)


def test_chunk_size_changes_only_rounding():
    kwargs = SPEC.case("small_varlen").build(seed=4)
    by_size = [reference(**dict(kwargs, chunk_size=q)) for q in (1, 4, 8, 32)]
    for y, final in by_size[1:]:
        torch.testing.assert_close(y, by_size[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, by_size[0][1], rtol=1e-5, atol=1e-5)


def test_splitting_a_sequence_carries_the_state():
    # Scanning tokens [0, 13) then [13, 30) from the first part's final state equals one scan:
    # the contract chunked prefill relies on.
    kwargs = _small((30,), 8)(torch.device("cpu"), torch.Generator().manual_seed(3))
    whole_y, whole_final = _chunked_fp64(kwargs)
    cut = 13
    first = dict(kwargs, cu_seqlens=torch.tensor([0, cut], dtype=torch.int32),
                 **{n: kwargs[n][:cut] for n in ("x", "dt", "B", "C", "z")})
    y1, mid = _chunked_fp64(first)
    second = dict(kwargs, cu_seqlens=torch.tensor([0, 30 - cut], dtype=torch.int32),
                  initial_states=mid, **{n: kwargs[n][cut:] for n in ("x", "dt", "B", "C", "z")})
    y2, final = _chunked_fp64(second)
    torch.testing.assert_close(torch.cat([y1, y2]), whole_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, whole_final, rtol=1e-12, atol=1e-12)


def test_empty_sequence_returns_its_initial_state_exactly():
    kwargs = SPEC.case("empty_sequence").build(seed=1)
    _, final = reference(**kwargs)
    assert torch.equal(final[1], kwargs["initial_states"][1])


def test_strong_decay_has_no_nan_and_forgets():
    kwargs = SPEC.case("strong_decay").build(seed=1)
    y, final = reference(**kwargs)
    assert bool(y.isfinite().all()) and bool(final.isfinite().all())
    # dt' ~ 5 and A <= -1: each token decays the state by ~exp(-5) or more, so after the last
    # 8 tokens nothing of the earlier ones (nor of the initial state) is left in fp32.
    assert float(SPEC.case("strong_decay").build(seed=1)["dt_bias"].min()) > 3.5
    last = dict(kwargs, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), initial_states=None,
                **{n: kwargs[n][-8:] for n in ("x", "dt", "B", "C", "z")})
    torch.testing.assert_close(final, reference(**last)[1], rtol=1e-4, atol=1e-4)


def test_dt_limits_clamp_the_step():
    # With dt_min = dt_max every step is exactly that value, whatever dt.
    kwargs = _small((6,), 4, dt_limit=(0.05, 0.05))(torch.device("cpu"),
                                                    torch.Generator().manual_seed(0))
    fixed = dict(kwargs, dt=torch.zeros_like(kwargs["dt"]), dt_bias=None, dt_softplus=False,
                 dt_min=0.05, dt_max=0.05)
    free = dict(fixed, dt=torch.full_like(kwargs["dt"], 0.05), dt_min=0.0,
                dt_max=NO_UPPER_DT_LIMIT)
    for got, want in zip(reference(**kwargs), reference(**free)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(reference(**fixed), reference(**free)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_infinite_dt_max_means_no_limit():
    kwargs = SPEC.case("small_varlen").build(seed=2)
    for got, want in zip(reference(**dict(kwargs, dt_max=math.inf)), reference(**kwargs)):
        assert torch.equal(got, want)


def _meta(kwargs):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    real = reference(**kwargs)
    fake = SPEC.fake(**_meta(kwargs))
    assert len(fake) == len(real) == 2
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")
    SPEC.validate(**kwargs)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), max_size=4),
    heads_per_group=st.integers(1, 3),
    groups=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    state_dim=st.integers(1, 4),
    dtype=st.sampled_from(spec_module.ACTIVATION_DTYPES),
    with_initial_states=st.booleans(),
    chunk_log2=st.integers(0, 4),
)
def test_fake_matches_reference_on_small_shapes(lengths, heads_per_group, groups, head_dim,
                                                state_dim, dtype, with_initial_states, chunk_log2):
    kwargs = spec_module._maker(tuple(lengths), heads_per_group * groups, head_dim, groups,
                                state_dim, dtype, 2**chunk_log2,
                                with_initial_states=with_initial_states)(
        torch.device("cpu"), torch.Generator().manual_seed(0))
    SPEC.validate(**kwargs)
    for r, f in zip(reference(**kwargs), SPEC.fake(**_meta(kwargs))):
        assert (f.shape, f.dtype, f.device.type) == (r.shape, r.dtype, "meta")


def test_cases_cover_the_model_and_edge_shapes():
    names = {c.name for c in SPEC.cases}
    assert {"mamba2_2.7b_t128", "mamba2_2.7b_t1024", "mamba2_2.7b_t1024_varlen"} <= names
    assert {"empty", "empty_sequence", "one_token", "chunk_size_1", "strong_decay"} <= names
    for case in SPEC.cases_tagged("model"):
        kwargs = case.build()
        assert (kwargs["x"].shape[1:], kwargs["B"].shape[1:]) == ((80, 64), (1, 128))
        assert kwargs["chunk_size"] == 256
    assert SPEC.cases_tagged("quick") and SPEC.cases_tagged("random")


def test_check_close_rejects_a_wrong_state():
    kwargs = SPEC.case("small_varlen").build()
    y, final = reference(**kwargs)
    SPEC.check_close((y, final), (y, final), kwargs)
    bad = final.clone()
    bad[1, 2, 3, 4] += 0.1
    with pytest.raises(AssertionError, match="final_states"):
        SPEC.check_close((y, bad), (y, final), kwargs)
    with pytest.raises(AssertionError, match="y: got"):
        SPEC.check_close((y.double(), final), (y, final), kwargs)


def test_cost_counts_each_input_and_output_once():
    kwargs = SPEC.case("mamba2_2.7b_t1024").build()
    cost = SPEC.cost(kwargs)
    t, h, p, n = 1024, 80, 64, 128
    inputs = (t * h * p * 2 * 2  # x, z bf16
              + t * h * 2 + h * 4 * 3  # dt bf16; A, D, dt_bias fp32
              + 2 * t * n * 2 + 2 * 4)  # B, C bf16; cu_seqlens
    assert cost.bytes == inputs + t * h * p * 2 + h * p * n * 4
    pairs = 4 * 256 * 257 // 2
    assert cost.flops == 2 * pairs * n + 2 * pairs * h * p + 4 * t * h * p * n + 2 * 4 * h * p * n


def _good(**changes):
    kwargs = _small((3, 5), 4, heads=4, head_dim=2, groups=2, state_dim=3)(
        torch.device("cpu"), torch.Generator().manual_seed(0))
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"x": torch.zeros(8, 4, 2, dtype=torch.int32)}, "x", "dtype in"),
        ({"x": torch.zeros(8, 8)}, "x", "3-d tensor"),
        ({"dt": torch.zeros(8, 3)}, "dt", "shape (8, 4)"),
        ({"dt": torch.zeros(8, 4, dtype=torch.float64)}, "dt", "dtype in"),
        ({"A": torch.zeros(4, dtype=torch.bfloat16)}, "A", "dtype in {float32}"),
        ({"A": torch.zeros(5)}, "A", "shape (4,)"),
        ({"B": torch.zeros(8, 3, 3)}, "B", "dividing the head count Hh = 4"),
        ({"B": torch.zeros(8, 0, 3)}, "B", "dividing the head count"),
        ({"B": torch.zeros(7, 2, 3)}, "B", "8 tokens"),
        ({"B": torch.zeros(8, 2, 3, dtype=torch.bfloat16)}, "B", "x's dtype"),
        ({"C": torch.zeros(8, 2, 4)}, "C", "shape (8, 2, 3)"),
        ({"C": torch.zeros(8, 2, 3, device="meta")}, "C", "on cpu"),
        ({"cu_seqlens": torch.tensor([0, 3, 8])}, "cu_seqlens", "dtype in {int32}"),
        ({"cu_seqlens": torch.zeros(0, dtype=torch.int32)}, "cu_seqlens", "at least [0]"),
        ({"cu_seqlens": torch.tensor([0, 3, 5, 8], dtype=torch.int32)}, "initial_states",
         "Bs = len(cu_seqlens) - 1"),
        ({"D": torch.zeros(4, 1)}, "D", "1-d tensor"),
        ({"dt_bias": torch.zeros(3)}, "dt_bias", "shape (4,)"),
        ({"z": torch.zeros(8, 4, 3)}, "z", "shape (8, 4, 2)"),
        ({"z": torch.zeros(8, 4, 2, dtype=torch.float16)}, "z", "x's dtype"),
        ({"dt_softplus": 1}, "dt_softplus", "a bool"),
        ({"dt_min": "0"}, "dt_min", "float"),
        ({"dt_min": -0.1}, "dt_min", "0 <= dt_min <= dt_max"),
        ({"dt_min": 0.2, "dt_max": 0.1}, "dt_max", "0 <= dt_min <= dt_max"),
        ({"dt_max": math.nan}, "dt_max", "0 <= dt_min <= dt_max"),
        ({"dt_min": math.nan}, "dt_min", "0 <= dt_min <= dt_max"),  # a NaN key never hits
        ({"initial_states": torch.zeros(2, 4, 2, 3, dtype=torch.bfloat16)}, "initial_states",
         "dtype in {float32}"),
        ({"initial_states": torch.zeros(2, 4, 2, 4)}, "initial_states", "shape (2, 4, 2, 3)"),
        ({"chunk_size": 0}, "chunk_size", ">= 1"),
        ({"chunk_size": 48}, "chunk_size", "power of two"),
        ({"chunk_size": 256.0}, "chunk_size", "a Python int"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "ssd_scan"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_positive_A_is_not_checked():
    # A value check would sync the device; A < 0 is a documented precondition.
    SPEC.validate(**_good(A=torch.ones(4)))


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.x_dtype, key.dt_dtype) == (torch.device("cpu"), torch.float32,
                                                       torch.float32)
    assert (key.num_heads, key.head_dim, key.num_groups, key.state_dim, key.chunk_size) == (
        4, 2, 2, 3, 4)
    assert (key.D_dtype, key.dt_bias_dtype, key.dt_softplus) == (torch.float32, torch.float32, True)
    # No upper limit is inf in the key, whichever way it was said; the limits are host floats.
    assert (key.dt_min, key.dt_max, key.has_dt_limit) == (0.0, math.inf, False)
    assert key == SPEC.validate(**_good(dt_max=math.inf))
    # T and Bs are classes (T = 8: class 15, Bs = 2: class 3); lengths and values are data.
    assert (key.num_tokens_class, key.num_seqs_class) == (15, 3)
    same_classes = _small((4, 4, 7), 4, heads=4, head_dim=2, groups=2, state_dim=3)(
        torch.device("cpu"), torch.Generator().manual_seed(5))
    assert key == SPEC.validate(**same_classes)
    longer = _small((9, 1, 20), 4, heads=4, head_dim=2, groups=2, state_dim=3)(
        torch.device("cpu"), torch.Generator().manual_seed(5))
    assert SPEC.validate(**longer) == key._replace(num_tokens_class=31)
    assert SPEC.validate(**_good(chunk_size=8)) == key._replace(chunk_size=8)
    assert SPEC.validate(**_good(z=None)) == key._replace(z_layout=None)
    assert SPEC.validate(**_good(initial_states=None)) == key._replace(initial_states_layout=None)
    limited = SPEC.validate(**_good(dt_min=0.001))
    assert limited == key._replace(dt_min=0.001) and limited.has_dt_limit
    assert SPEC.validate(**_good(dt_max=0.5)).dt_max == 0.5
    assert key != SPEC.validate(**_good(dt_bias=torch.zeros(4, dtype=torch.bfloat16)))
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_its_layout_field():
    kwargs = _good()
    key = SPEC.validate(**kwargs)
    assert key.B_layout == Layout(unit_stride=True, alignment=4)  # rows of N = 3 fp32
    assert key.x_layout == Layout(unit_stride=True, alignment=8)  # rows of P = 2 fp32
    # x one element into a wider buffer: P no longer a whole number of 8-byte words apart.
    shifted = SPEC.validate(**{**kwargs, "x": torch.zeros(8, 4, 3)[:, :, 1:]})
    assert shifted.x_layout == Layout(unit_stride=True, alignment=4)
    assert shifted._replace(x_layout=key.x_layout) == key
    # B with tokens as the contiguous dim (a transposed projection output).
    B = kwargs["B"].permute(1, 2, 0).contiguous().permute(2, 0, 1)
    strided = SPEC.validate(**{**kwargs, "B": B})
    assert not strided.B_layout.unit_stride
    assert strided._replace(B_layout=key.B_layout) == key


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_check_data_passes_on_every_case(case):
    SPEC.check_data(**case.build())


@pytest.mark.parametrize("index, value, expected, actual", [
    (-1, 46, "cu_seqlens[-1] = T (x.shape[0]) = 45", "cu_seqlens[4] = 46"),  # T + 1
    (-1, 44, "cu_seqlens[-1] = T (x.shape[0]) = 45", "cu_seqlens[4] = 44"),  # T - 1
    (2, 3, "nondecreasing", "cu_seqlens[2] = 3 < cu_seqlens[1] = 5"),
    (0, 1, "cu_seqlens[0] = 0", "cu_seqlens[0] = 1"),
])
def test_check_data_rejects_offsets_that_do_not_partition_the_tokens(index, value, expected, actual):
    kwargs = SPEC.case("small_varlen").build()  # lengths (5, 16, 1, 23): cu_seqlens ends at 45
    assert kwargs["cu_seqlens"].tolist() == [0, 5, 21, 22, 45]
    kwargs["cu_seqlens"][index] = value
    with pytest.raises(DeviceDataError) as info:
        SPEC.check_data(**kwargs)
    assert (info.value.op, info.value.argument) == ("ssd_scan", "cu_seqlens")
    assert expected in info.value.expected and actual in str(info.value), str(info.value)
