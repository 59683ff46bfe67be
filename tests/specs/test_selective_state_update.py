"""The selective_state_update spec: its reference against one step of the recurrence and against
ssd_scan, padding and slot handling, validation, fake, cases and cost."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelmux.errors import DeviceDataError, InvalidArgumentError
from kernelmux.specs._key import Layout
from kernelmux.specs import selective_state_update as spec_module
from kernelmux.specs import ssd_scan as ssd_module
from kernelmux.specs.selective_state_update import SPEC

reference = SPEC.reference


def one_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
             state_batch_indices=None):
    """The recurrence's step, request by request and head by head in fp64. Returns y and the
    new state of each live request (keyed by slot); touches nothing."""
    heads = x.shape[1]
    per_group = heads // B.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    new_states = {}
    for b in range(x.shape[0]):
        slot = b if state_batch_indices is None else int(state_batch_indices[b])
        if slot < 0:
            continue
        new = torch.empty(state.shape[1:], dtype=torch.float64)
        for h in range(heads):
            g = h // per_group
            step = dt[b, h].double() + (dt_bias[h].double() if dt_bias is not None else 0.0)
            if dt_softplus:
                step = F.softplus(step)
            new[h] = (torch.exp(step * A[h].double()) * state[slot, h].double()
                      + step * torch.outer(x[b, h].double(), B[b, g].double()))
            out = new[h] @ C[b, g].double()
            if D is not None:
                out = out + D[h].double() * x[b, h].double()
            if z is not None:
                out = out * F.silu(z[b, h].double())
            y[b, h] = out
        new_states[slot] = new
    return y, new_states


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@settings(max_examples=40, deadline=None)
@given(
    requests=st.integers(0, 6),
    extra_slots=st.integers(0, 4),
    data=st.data(),
    heads_per_group=st.integers(1, 3),
    groups=st.integers(1, 2),
    head_dim=st.integers(1, 3),
    state_dim=st.integers(1, 4),
    use_indices=st.booleans(),
    with_d=st.booleans(),
    with_z=st.booleans(),
    with_dt_bias=st.booleans(),
    dt_softplus=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_is_one_step_of_the_recurrence(requests, extra_slots, data, heads_per_group,
                                                 groups, head_dim, state_dim, use_indices, with_d,
                                                 with_z, with_dt_bias, dt_softplus, seed):
    padding = data.draw(st.integers(0, requests)) if use_indices else 0
    make = spec_module._maker(requests, heads_per_group * groups, head_dim, groups, state_dim,
                              torch.float32, slots=requests + extra_slots if use_indices else None,
                              padding=padding, with_d=with_d, with_z=with_z,
                              with_dt_bias=with_dt_bias, dt_softplus=dt_softplus)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    SPEC.validate(**kwargs)
    before = kwargs["state"].clone()
    want_y, want_states = one_step(**kwargs)
    y = reference(**kwargs)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-6)
    state = kwargs["state"]
    for slot in range(state.shape[0]):
        if slot in want_states:
            torch.testing.assert_close(state[slot].double(), want_states[slot], rtol=1e-5,
                                       atol=1e-6)
        else:  # sentinel (NaN) slots and slots of padding requests: bit-for-bit untouched
            assert torch.equal(_bits(state[slot]), _bits(before[slot])), f"slot {slot} touched"
    indices = kwargs["state_batch_indices"]
    if indices is not None:
        assert not bool(y[indices < 0].ne(0).any()), "padding rows of y must be zero"


@pytest.mark.parametrize("case", [c for c in SPEC.cases if "model" not in c.tags],
                         ids=lambda c: c.name)
def test_small_cases_conform_to_one_step(case):
    kwargs = case.build(seed=7)
    want_y, want_states = one_step(**kwargs)
    want_state = kwargs["state"].clone()
    for slot, new in want_states.items():
        want_state[slot] = new.to(want_state.dtype)
    actual = SPEC.outputs(reference(**kwargs), kwargs)
    SPEC.check_close(actual, (want_y.to(kwargs["x"].dtype), want_state), kwargs)


def test_bf16_state_stores_the_rounded_fp32_update_and_reads_y_before_rounding():
    kwargs = SPEC.case("small_padded_bf16").build(seed=3)
    fp32 = dict(kwargs, state=kwargs["state"].float())
    y32 = reference(**fp32)
    y16 = reference(**kwargs)
    live = kwargs["state_batch_indices"] >= 0
    slots = kwargs["state_batch_indices"][live].long()
    # The same math on the same (exactly upcast) values: the bf16 cache holds the fp32 result
    # rounded once, and y is identical because it is read from the unrounded state.
    assert torch.equal(kwargs["state"][slots], fp32["state"][slots].to(torch.bfloat16))
    assert torch.equal(y16, y32)


def test_permuted_slots_follow_their_requests():
    # Reversing the request order together with their slots permutes y and leaves the same cache.
    kwargs = SPEC.case("small_permuted").build(seed=1)
    flipped = {k: (v.flip(0) if k in ("x", "dt", "B", "C", "z", "state_batch_indices") else v)
               for k, v in kwargs.items()}
    flipped["state"] = kwargs["state"].clone()
    y = reference(**kwargs)
    y_flipped = reference(**flipped)
    assert torch.equal(y_flipped.flip(0), y)
    assert torch.equal(_bits(flipped["state"]), _bits(kwargs["state"]))


@pytest.mark.parametrize("case", ["small_permuted", "small_padded_bf16", "small_fp16_params", "no_indices"])
def test_a_request_gets_the_same_bits_alone_as_in_its_batch(case):
    # The property the permutation test relies on, request by request: y's row and the new state
    # of a request depend on its own inputs only, not on which requests share the batch or where
    # it sits (a batch of one puts every element in other positions of each tensor).
    kwargs = SPEC.case(case).build(seed=5)
    before = kwargs["state"].clone()
    y = reference(**kwargs)
    indices = kwargs["state_batch_indices"]
    for request in range(y.shape[0]):
        slot = request if indices is None else int(indices[request])
        if slot < 0:
            continue
        alone = {k: (v[request:request + 1] if k in ("x", "dt", "B", "C", "z", "state_batch_indices")
                     and v is not None else v) for k, v in kwargs.items()}
        alone["state"] = before.clone()
        if indices is None:  # a batch of one addresses a cache of one slot
            alone["state"] = before[request:request + 1].clone()
        y_alone = reference(**alone)
        assert torch.equal(_bits(y_alone[0]), _bits(y[request])), f"request {request}: y differs"
        state_alone = alone["state"][0 if indices is None else slot]
        assert torch.equal(_bits(state_alone), _bits(kwargs["state"][slot])), f"request {request}: state"


def test_padding_requests_do_not_read_their_slot():
    # A padding request's index is negative; what its x, dt, B, C hold must not matter, even NaN.
    kwargs = SPEC.case("small_padded_bf16").build(seed=2)
    pad = kwargs["state_batch_indices"] < 0
    poisoned = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    for name in ("x", "dt", "B", "C", "z"):
        poisoned[name][pad] = float("nan")
    y, y_poisoned = reference(**kwargs), reference(**poisoned)
    assert torch.equal(y, y_poisoned)
    assert torch.equal(_bits(kwargs["state"]), _bits(poisoned["state"]))


def test_check_close_catches_a_touched_padding_slot_and_nonzero_padding_rows():
    kwargs = SPEC.case("small_padded_bf16").build(seed=4)
    expected_kwargs = SPEC.case("small_padded_bf16").build(seed=4)
    expected = SPEC.outputs(reference(**expected_kwargs), expected_kwargs)
    y = reference(**kwargs)
    SPEC.check_close(SPEC.outputs(y, kwargs), expected, kwargs)
    indices = kwargs["state_batch_indices"]
    free_slot = next(s for s in range(kwargs["state"].shape[0]) if s not in indices.tolist())
    touched = kwargs["state"].clone()
    touched[free_slot] = 0
    with pytest.raises(AssertionError, match="belong to no live request"):
        SPEC.check_close((y, touched), expected, kwargs)
    bad_y = y.clone()
    bad_y[indices < 0] = 1e-3
    with pytest.raises(AssertionError, match="padding rows"):
        SPEC.check_close((bad_y, kwargs["state"]), expected, kwargs)


@pytest.mark.parametrize("prefix", [1, 7, 8, 13])
def test_decode_step_continues_the_prefill_scan(prefix):
    # ssd_scan over `prefix` tokens, then one decode step, equals ssd_scan over prefix + 1 tokens:
    # the same y for the new token and the same final state. Two sequences, chunk 4 (so prefixes
    # below, at and beyond chunk boundaries), fp32 throughout.
    heads, head_dim, groups, state_dim = 6, 4, 3, 8
    lengths = (prefix + 1, prefix + 3)
    kwargs = ssd_module._maker(lengths, heads, head_dim, groups, state_dim, torch.float32, 4)(
        torch.device("cpu"), torch.Generator().manual_seed(prefix))
    full_y, full_final = ssd_module.ssd_scan(**kwargs)
    # Sequence 0 drops its last token; that token becomes the decode step.
    last = lengths[0] - 1
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[last] = False
    prefill = dict(kwargs, cu_seqlens=torch.tensor([0, prefix, prefix + lengths[1]],
                                                   dtype=torch.int32),
                   **{n: kwargs[n][keep] for n in ("x", "dt", "B", "C", "z")})
    _, states = ssd_module.ssd_scan(**prefill)
    # The cache holds both sequences' states in swapped slots, plus an unused slot.
    cache = torch.full((3, heads, head_dim, state_dim), float("nan"))
    cache[2], cache[0] = states[0], states[1]
    y = reference(cache, *(kwargs[n][last:last + 1] for n in ("x", "dt")), kwargs["A"],
                  kwargs["B"][last:last + 1], kwargs["C"][last:last + 1], kwargs["D"],
                  kwargs["z"][last:last + 1], kwargs["dt_bias"], True,
                  torch.tensor([2], dtype=torch.int32))
    torch.testing.assert_close(y[0], full_y[last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[2], full_final[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[0], states[1]) and bool(cache[1].isnan().all())


def _meta(kwargs):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_fake_matches_reference_metadata(case):
    kwargs = case.build(seed=3)
    SPEC.validate(**kwargs)
    real = reference(**kwargs)
    fake = SPEC.fake(**_meta(kwargs))
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")


@settings(max_examples=30, deadline=None)
@given(
    requests=st.integers(0, 5),
    heads_per_group=st.integers(1, 3),
    groups=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    state_dim=st.integers(1, 4),
    dtype=st.sampled_from(spec_module.ACTIVATION_DTYPES),
    state_dtype=st.sampled_from(spec_module.STATE_DTYPES),
    use_indices=st.booleans(),
)
def test_fake_matches_reference_on_small_shapes(requests, heads_per_group, groups, head_dim,
                                                state_dim, dtype, state_dtype, use_indices):
    kwargs = spec_module._maker(requests, heads_per_group * groups, head_dim, groups, state_dim,
                                dtype, state_dtype, slots=requests + 2 if use_indices else None)(
        torch.device("cpu"), torch.Generator().manual_seed(0))
    SPEC.validate(**kwargs)
    real, fake = reference(**kwargs), SPEC.fake(**_meta(kwargs))
    assert (fake.shape, fake.dtype, fake.device.type) == (real.shape, real.dtype, "meta")


def test_cases_cover_the_model_and_edge_shapes():
    names = {c.name for c in SPEC.cases}
    assert {"mamba2_2.7b_b1", "mamba2_2.7b_b8", "mamba2_2.7b_b64"} <= names
    assert {"all_padding", "empty", "no_options"} <= names
    for case in SPEC.cases_tagged("model"):
        kwargs = case.build()
        assert kwargs["state"].shape[1:] == (80, 64, 128) and kwargs["B"].shape[1] == 1
    assert SPEC.mutates_args == ("state",)


def test_cost_counts_live_requests_only():
    kwargs = SPEC.case("mamba2_2.7b_b64_padded").build()
    cost = SPEC.cost(kwargs)
    live, elements = 59, 80 * 64 * 128
    assert cost.flops == 6 * live * elements
    inputs = (64 * 80 * 64 * 2 * 2 + 64 * 80 * 2 + 80 * 4 * 3 + 2 * 64 * 128 * 2 + 64 * 4)
    assert cost.bytes == inputs + 2 * live * elements * 4 + 64 * 80 * 64 * 2


def _good(**changes):
    kwargs = spec_module._maker(3, 4, 2, 2, 5, torch.float32, slots=6)(
        torch.device("cpu"), torch.Generator().manual_seed(0))
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"state": torch.zeros(6, 4, 2, 5, dtype=torch.float16)}, "state", "dtype in"),
        ({"state": torch.zeros(6, 4, 2)}, "state", "4-d tensor"),
        ({"state": torch.zeros(6, 4, 3, 5)}, "state", "x's Hh and P"),
        ({"state": torch.zeros(6, 4, 2, 5, device="meta")}, "state", "on cpu"),
        ({"x": torch.zeros(3, 4, 2, dtype=torch.int8)}, "x", "dtype in"),
        ({"dt": torch.zeros(3, 5)}, "dt", "shape (3, 4)"),
        ({"A": torch.zeros(4, dtype=torch.float16)}, "A", "dtype in {float32}"),
        ({"A": torch.zeros(3)}, "A", "shape (4,)"),
        ({"B": torch.zeros(3, 3, 5), "C": torch.zeros(3, 3, 5)}, "B", "dividing the head count"),
        ({"B": torch.zeros(3, 2, 4)}, "B", "state's N"),
        ({"B": torch.zeros(2, 2, 5)}, "B", "x's Bs"),
        ({"C": torch.zeros(3, 2, 5, dtype=torch.bfloat16)}, "C", "x's dtype"),
        ({"D": torch.zeros(5)}, "D", "shape (4,)"),
        ({"dt_bias": torch.zeros(4, dtype=torch.int32)}, "dt_bias", "dtype in"),
        ({"z": torch.zeros(3, 4, 1)}, "z", "shape (3, 4, 2)"),
        ({"dt_softplus": "yes"}, "dt_softplus", "a bool"),
        ({"state_batch_indices": torch.zeros(3, dtype=torch.int64)}, "state_batch_indices",
         "dtype in {int32}"),
        ({"state_batch_indices": torch.zeros(4, dtype=torch.int32)}, "state_batch_indices",
         "shape (3,)"),
        ({"state_batch_indices": None}, "state", "3 slots (one per request)"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "selective_state_update"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    assert isinstance(key, spec_module.Key)
    assert (key.device, key.state_dtype, key.x_dtype, key.dt_dtype) == (
        torch.device("cpu"), torch.float32, torch.float32, torch.float32)
    assert (key.num_heads, key.head_dim, key.num_groups, key.state_dim) == (4, 2, 2, 5)
    assert (key.D_dtype, key.dt_bias_dtype, key.dt_softplus) == (torch.float32, torch.float32, True)
    assert key.state_batch_indices_layout is not None and key.z_layout is not None
    # Bs and S are classes (Bs = 3: class 3; S = 6: class 7); padding is data, not in the key.
    assert (key.num_requests_class, key.num_slots_class) == (3, 7)
    same_classes = spec_module._maker(2, 4, 2, 2, 5, torch.float32, slots=5, padding=1)(
        torch.device("cpu"), torch.Generator().manual_seed(1))
    assert key == SPEC.validate(**same_classes)
    more = spec_module._maker(5, 4, 2, 2, 5, torch.float32, slots=40, padding=2)(
        torch.device("cpu"), torch.Generator().manual_seed(1))
    assert SPEC.validate(**more) == key._replace(num_requests_class=7, num_slots_class=63)
    assert key != SPEC.validate(**_good(state=torch.zeros(6, 4, 2, 5, dtype=torch.bfloat16)))
    assert SPEC.validate(**_good(z=None)) == key._replace(z_layout=None)
    assert SPEC.validate(**_good(dt_softplus=False)) == key._replace(dt_softplus=False)
    assert SPEC.validate(**_good(D=None)) == key._replace(D_dtype=None, D_layout=None)
    no_indices = spec_module._maker(3, 4, 2, 2, 5, torch.float32)(
        torch.device("cpu"), torch.Generator().manual_seed(0))
    assert SPEC.validate(**no_indices).state_batch_indices_layout is None
    SPEC.validate(**_good(A=torch.ones(4)))  # A < 0 is a precondition: no value check (sync)
    hash(key)


def test_a_misaligned_or_strided_view_changes_only_its_layout_field():
    kwargs = _good()
    key = SPEC.validate(**kwargs)
    assert key.x_layout == Layout(unit_stride=True, alignment=8)  # rows of P = 2 fp32
    # x one element into a wider buffer: P is no longer contiguous with the next head.
    shifted = SPEC.validate(**{**kwargs, "x": torch.zeros(3, 4, 3)[:, :, 1:]})
    assert shifted.x_layout == Layout(unit_stride=True, alignment=4)
    assert shifted._replace(x_layout=key.x_layout) == key
    # the state cache with P and N swapped in memory: N is not the contiguous dim.
    state = kwargs["state"].transpose(2, 3).contiguous().transpose(2, 3)
    strided = SPEC.validate(**{**kwargs, "state": state})
    assert not strided.state_layout.unit_stride
    assert strided._replace(state_layout=key.state_layout) == key


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_check_data_passes_on_every_case(case):
    SPEC.check_data(**case.build())


def _check_data_error(kwargs):
    with pytest.raises(DeviceDataError) as info:
        SPEC.check_data(**kwargs)
    assert info.value.op == "selective_state_update"
    assert info.value.argument == "state_batch_indices"
    return info.value


def test_check_data_rejects_a_slot_outside_the_cache():
    kwargs = SPEC.case("small_permuted").build()  # S = 9
    kwargs["state_batch_indices"][3] = 9
    error = _check_data_error(kwargs)
    assert "< 9" in error.expected and "state_batch_indices[3] = 9" in str(error), str(error)
    kwargs["state_batch_indices"][3] = -7  # any negative index is padding
    SPEC.check_data(**kwargs)


def test_check_data_rejects_a_slot_shared_by_two_live_requests():
    kwargs = SPEC.case("small_padded_bf16").build()  # two padding requests: -1 may repeat
    indices = kwargs["state_batch_indices"]
    live = (indices >= 0).nonzero().flatten().tolist()
    indices[live[2]] = indices[live[0]]
    error = _check_data_error(kwargs)
    assert "distinct" in error.expected
    assert f"state_batch_indices[{live[0]}] = state_batch_indices[{live[2]}]" in str(error)
