"""The kv_cache_write spec: padding left untouched, fp8 bytes against hand-worked codes, a write ->
paged_attention round trip, a loop oracle on drawn shapes, validation, fake, cases and cost."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._compare import assert_close
from kernelmux.specs._spec import Tolerance
from kernelmux.specs import kv_cache_write as spec_module
from kernelmux.specs.kv_cache_write import SPEC
from kernelmux.specs.paged_attention import SPEC as ATTENTION

reference = SPEC.reference
FP8 = torch.float8_e4m3fn


def _loop_oracle(kwargs):
    """The expected caches, one token and one slot at a time."""
    k_cache, v_cache = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(kwargs["slot_mapping"].tolist()):
        if slot < 0:
            continue
        for new, cache, scale in ((kwargs["key"], k_cache, kwargs["k_scale"]),
                                  (kwargs["value"], v_cache, kwargs["v_scale"])):
            row = new[t].float()
            if cache.dtype == FP8:
                row = (row / (scale.item() if scale is not None else 1.0)).clamp(-448, 448)
            cache[slot // block_size, slot % block_size] = row.to(cache.dtype)
    return k_cache, v_cache


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8])
def test_padding_and_other_slots_keep_a_sentinel(cache_dtype):
    dtype = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    num_blocks, block_size = 5, 4
    k_cache = torch.full((num_blocks, block_size, 2, 8), 7.0).to(cache_dtype)
    v_cache = torch.full((num_blocks, block_size, 2, 8), -3.0).to(cache_dtype)
    slots = torch.tensor([13, -1, 0, 19, -8, 6], dtype=torch.int64)
    key = torch.randn(6, 2, 8, dtype=dtype)
    value = torch.randn(6, 2, 8, dtype=dtype)
    scales = (torch.tensor(0.5), torch.tensor([0.25])) if cache_dtype == FP8 else (None, None)
    assert reference(key, value, k_cache, v_cache, slots, *scales) is None
    written = {13: 0, 0: 2, 19: 3, 6: 5}
    for slot in range(num_blocks * block_size):
        block, offset = divmod(slot, block_size)
        for cache, new, sentinel, scale in ((k_cache, key, 7.0, scales[0]), (v_cache, value, -3.0, scales[1])):
            got = cache[block, offset].float()
            if slot in written:
                want = new[written[slot]].float()
                if cache_dtype == FP8:
                    want = (want / scale.reshape(())).to(FP8).float()
                assert torch.equal(got, want), slot
            else:
                assert bool((got == sentinel).all()), f"slot {slot} was touched"


def test_fp8_bytes_are_hand_worked_values():
    # x / scale, saturated to +-448, rounded to nearest even: e4m3fn is s eeee mmm, bias 7.
    scale = torch.tensor(0.5)
    values = torch.tensor([
        1.0,         # 2.0 = 1.0 * 2^1          -> 0 1000 000 = 0x40
        0.30078125,  # 0.6015625 (bf16 of 0.3 / 0.5) -> 1.25 * 2^-1 = 0.625, nearest -> 0x32
        0.53125,     # 1.0625: halfway between 1.0 and 1.125 -> even mantissa 0 -> 0x38
        0.59375,     # 1.1875: halfway between 1.125 and 1.25 -> even mantissa 2 -> 0x3A
        1000.0,      # 2000 saturates to 448 = 1.75 * 2^8 -> 0 1111 110 = 0x7E
        -1000.0,     # -448 -> 0xFE
        -0.0,        # -0.0 -> 0x80
        2.0**-11,    # 2^-10: halfway between 0 and the smallest subnormal 2^-9 -> 0 -> 0x00
        3 * 2.0**-11,  # 3 * 2^-10: halfway between 2^-9 (m 1) and 2^-8 (m 2) -> even -> 0x02
        0.375,       # 0.75 = 1.5 * 2^-1 -> 0 0110 100 = 0x34
    ], dtype=torch.bfloat16)
    expected = [0x40, 0x32, 0x38, 0x3A, 0x7E, 0xFE, 0x80, 0x00, 0x02, 0x34]
    n = values.numel()
    key = values.reshape(n, 1, 1)
    k_cache = torch.zeros(n, 1, 1, 1, dtype=FP8)
    v_cache = torch.zeros(n, 1, 1, 1, dtype=FP8)
    slots = torch.arange(n - 1, -1, -1)  # reversed, so slot s holds value n - 1 - s
    reference(key, key, k_cache, v_cache, slots, scale, torch.tensor(1.0))
    assert k_cache.view(torch.uint8).flatten().flip(0).tolist() == expected
    # v_scale 1.0: 1.0 -> 0x38, 1000 -> 0x7E (saturated), 0.375 -> 0 0101 100 = 0x2C
    got_v = v_cache.view(torch.uint8).flatten().flip(0).tolist()
    assert (got_v[0], got_v[4], got_v[9]) == (0x38, 0x7E, 0x2C)


def test_fp8_divides_rather_than_multiplying_by_the_reciprocal():
    # 0.02197265625 / 0.9f is exactly 0.0244140625 in fp32, the midpoint of e4m3 codes 0x0C
    # (0.0234375) and 0x0D (0.025390625): a tie, so nearest-even gives 0x0C. x * (1 / 0.9f) lands
    # one fp32 ulp above the midpoint and gives 0x0D: the spec's division is observable.
    key = torch.full((1, 1, 1), 0.02197265625, dtype=torch.bfloat16)
    k_cache = torch.zeros(1, 1, 1, 1, dtype=FP8)
    v_cache = torch.zeros(1, 1, 1, 1, dtype=FP8)
    reference(key, key, k_cache, v_cache, torch.tensor([0]), torch.tensor(0.9), None)
    assert k_cache.view(torch.uint8).item() == 0x0C
    assert v_cache.view(torch.uint8).item() == 0x0B  # no v_scale: nearest is 1.375 * 2^-6


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_round_trip_through_paged_attention(cache_dtype):
    # Write three sequences' K/V (one written in two steps) through a block table, then read them
    # back with paged_attention; compare with attention computed on the dense K/V directly.
    gen = torch.Generator().manual_seed(5)
    lengths, num_kv_heads, num_heads, head_dim, block_size = (7, 1, 12), 2, 4, 16, 4
    num_blocks = 12
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = spec_module.random_cache(cache_shape, cache_dtype, gen)
    v_cache = spec_module.random_cache(cache_shape, cache_dtype, gen)
    table = torch.full((3, 5), 0, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    table[0, :2], table[1, :1], table[2, :3] = ids[:2], ids[2:3], ids[3:6]
    scales = (torch.tensor(0.25), torch.tensor(0.5)) if cache_dtype == FP8 else (None, None)
    dense_k, dense_v = [], []
    for step in ((0, 5), (5, None)):  # positions [0, 5) first, then the rest
        keys, values, slots = [], [], []
        for b, length in enumerate(lengths):
            lo, hi = step[0], step[1] if step[1] is not None else length
            for j in range(min(lo, length), min(hi, length)):
                keys.append(torch.randn(num_kv_heads, head_dim, generator=gen, dtype=torch.bfloat16))
                values.append(torch.randn(num_kv_heads, head_dim, generator=gen, dtype=torch.bfloat16))
                slots.append(int(table[b, j // block_size]) * block_size + j % block_size)
            slots.append(-1)  # a padding token per sequence
            keys.append(torch.full((num_kv_heads, head_dim), 99.0, dtype=torch.bfloat16))
            values.append(torch.full((num_kv_heads, head_dim), 99.0, dtype=torch.bfloat16))
        reference(torch.stack(keys), torch.stack(values), k_cache, v_cache, torch.tensor(slots), *scales)
        dense_k.append(torch.stack(keys))
        dense_v.append(torch.stack(values))
    query = torch.randn(sum(lengths), num_heads, head_dim, generator=gen, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    out = ATTENTION.reference(query, k_cache, v_cache, cu, table, torch.tensor(lengths, dtype=torch.int32),
                              12, 12, head_dim**-0.5, True, 0, 0.0, None, *scales)
    # Dense expectation: each sequence's K/V in position order, quantized the same way for fp8.
    order_k, order_v = _dense_in_order(dense_k, dense_v, lengths)
    for b, length in enumerate(lengths):
        k, v = order_k[b].float(), order_v[b].float()
        if cache_dtype == FP8:
            k = spec_module.quantize_to_cache_fp8(k, scales[0]).float() * 0.25
            v = spec_module.quantize_to_cache_fp8(v, scales[1]).float() * 0.5
        q = query[cu[b]:cu[b + 1]].float()
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=head_dim**-0.5).transpose(0, 1)
        assert_close(out[cu[b]:cu[b + 1]], expected, Tolerance(atol=1e-5, rtol=2**-8 * 1.01), f"seq {b}")


def _dense_in_order(dense_k, dense_v, lengths):
    """Undo the two-step packing: per sequence, step-1 rows then step-2 rows (padding dropped)."""
    per_k, per_v = [[] for _ in lengths], [[] for _ in lengths]
    for step, (keys, values) in enumerate(zip(dense_k, dense_v)):
        row = 0
        for b, length in enumerate(lengths):
            count = min(5, length) if step == 0 else max(0, length - 5)
            per_k[b].append(keys[row:row + count])
            per_v[b].append(values[row:row + count])
            row += count + 1  # skip the padding row
    return [torch.cat(k) for k in per_k], [torch.cat(v) for v in per_v]


@given(
    tokens=st.integers(0, 20),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 8, 24]),
    block_size=st.sampled_from([1, 4, 16]),
    cache_dtype=st.sampled_from([None, FP8]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    padding=st.sampled_from([0.0, 0.4, 1.0]),
    scaled=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_loop_oracle(tokens, num_kv_heads, head_dim, block_size, cache_dtype, dtype,
                                       padding, scaled, seed):
    num_blocks = -(-tokens // block_size) + 2
    scales = (0.37, 0.011) if scaled and cache_dtype == FP8 else None
    make = spec_module._maker(tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, cache_dtype,
                              padding, scales, magnitude=6.0)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(seed))
    expected = _loop_oracle(kwargs)
    assert reference(**kwargs) is None
    SPEC.check_close(SPEC.outputs(None, kwargs), expected, kwargs)
    assert SPEC.fake(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}) is None


def test_writes_through_a_strided_cache_view():
    # vLLM may hand each cache as a view of one [2, num_blocks, ...] tensor, or with padded strides.
    joint = torch.randn(2, 6, 4, 2, 8 * 2, dtype=torch.bfloat16)
    k_cache, v_cache = joint[0, ..., ::2], joint[1, ..., ::2]
    assert not k_cache.is_contiguous()
    kwargs = dict(key=torch.randn(5, 2, 8, dtype=torch.bfloat16), value=torch.randn(5, 2, 8, dtype=torch.bfloat16),
                  k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.tensor([3, -1, 22, 0, 9]),
                  k_scale=None, v_scale=None)
    expected = _loop_oracle(kwargs)
    untouched = joint[..., 1::2].clone()
    reference(**kwargs)
    SPEC.check_close((joint[0, ..., ::2], joint[1, ..., ::2]), expected, kwargs)
    assert torch.equal(joint[..., 1::2], untouched)


def test_check_close_reports_a_wrong_slot():
    kwargs = SPEC.case("small_fp16_padding").build(seed=2)
    expected = _loop_oracle(kwargs)
    reference(**kwargs)
    k_cache, v_cache = SPEC.outputs(None, kwargs)
    k_cache[0, 1, 0, 0] += 1
    with pytest.raises(AssertionError, match=r"k_cache: 1 of .* differ .*\(0, 1, 0, 0\) \(slot 1\)"):
        SPEC.check_close((k_cache, v_cache), expected, kwargs)


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_cases_fake_validate_and_oracle(case):
    kwargs = case.build(seed=3)
    SPEC.validate(**kwargs)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    assert SPEC.fake(**meta) is None  # the reference returns None too: the outputs are the caches
    # The Python-loop oracle costs ~10 us per token: every case but the 8192-token one.
    expected = _loop_oracle(kwargs) if kwargs["key"].shape[0] <= 1024 else None
    assert reference(**kwargs) is None
    if expected is not None:
        SPEC.check_close(SPEC.outputs(None, kwargs), expected, kwargs)


def test_cases_cover_the_brief():
    names = {c.name for c in SPEC.cases}
    assert {"empty", "all_padding", "small_fp8_scales", "llama3_8b_fp8_prefill_t1024"} <= names
    for tag in ("model", "random", "edge", "quick"):
        assert SPEC.cases_tagged(tag), tag
    kwargs = SPEC.case("llama3_8b_fp8_prefill_t1024").build()
    # The fp8 model case must exercise saturation.
    q = kwargs["key"].float() / kwargs["k_scale"]
    assert bool((q.abs() > 448).any())


def test_cost_counts_written_rows():
    kwargs = SPEC.case("small_fp16_padding").build(seed=1)
    written = int((kwargs["slot_mapping"] >= 0).sum())
    assert 0 < written < 37
    cost = SPEC.cost(kwargs)
    assert cost.bytes == 2 * written * 3 * 40 * 2 * 2 + 37 * 8
    assert cost.flops == 0


def _good(**changes):
    kwargs = dict(key=torch.randn(4, 2, 8, dtype=torch.bfloat16), value=torch.randn(4, 2, 8, dtype=torch.bfloat16),
                  k_cache=torch.zeros(3, 4, 2, 8, dtype=FP8), v_cache=torch.zeros(3, 4, 2, 8, dtype=FP8),
                  slot_mapping=torch.tensor([0, 5, -1, 7]), k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]))
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "changes, argument, fragment",
    [
        ({"key": torch.zeros(4, 2, 8)}, "key", "dtype in"),
        ({"key": torch.zeros(4, 16, dtype=torch.bfloat16)}, "key", "3-d tensor"),
        ({"key": None}, "key", "torch.Tensor"),
        ({"value": torch.zeros(4, 2, 8, dtype=torch.float16)}, "value", "dtype in"),
        ({"value": torch.zeros(4, 2, 4, dtype=torch.bfloat16)}, "value", "shape (4, 2, 8)"),
        ({"k_cache": torch.zeros(3, 4, 2, 8, dtype=torch.float16)}, "k_cache", "dtype in"),
        ({"k_cache": torch.zeros(12, 2, 8, dtype=FP8)}, "k_cache", "4-d tensor"),
        ({"k_cache": torch.zeros(3, 4, 2, 16, dtype=FP8)}, "k_cache", "(num_blocks, block_size, 2, 8)"),
        ({"k_cache": torch.zeros(3, 4, 1, 8, dtype=FP8)}, "k_cache", "(num_blocks, block_size, 2, 8)"),
        ({"v_cache": torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)}, "v_cache", "dtype in"),
        ({"v_cache": torch.zeros(3, 2, 2, 8, dtype=FP8)}, "v_cache", "k_cache's"),
        ({"v_cache": torch.zeros(3, 4, 2, 8, dtype=FP8, device="meta")}, "v_cache", "on cpu"),
        ({"slot_mapping": torch.tensor([0, 5, -1, 7], dtype=torch.int32)}, "slot_mapping", "dtype in"),
        ({"slot_mapping": torch.tensor([0, 5, -1])}, "slot_mapping", "shape (4,)"),
        ({"slot_mapping": torch.zeros(4, 1, dtype=torch.int64)}, "slot_mapping", "1-d tensor"),
        ({"k_scale": 0.5}, "k_scale", "torch.Tensor"),
        ({"k_scale": torch.tensor([0.5, 0.5])}, "k_scale", "shape () or (1,)"),
        ({"v_scale": torch.tensor(2.0, dtype=torch.bfloat16)}, "v_scale", "fp32"),
        ({"v_scale": torch.tensor(2.0, device="meta")}, "v_scale", "on cpu"),
        ({"k_cache": torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16),
          "v_cache": torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)}, "k_scale", "float8_e4m3fn caches only"),
    ],
)
def test_bad_input_names_the_argument(changes, argument, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SPEC.validate(**_good(**changes))
    assert info.value.argument == argument
    assert info.value.op == "kv_cache_write"
    assert fragment in str(info.value), str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes_and_key_reflects_dispatch_properties():
    key = SPEC.validate(**_good())
    # T enters as its power-of-two class: 4 and 7 share a key, 8 does not.
    assert key == SPEC.validate(**_good(key=torch.randn(7, 2, 8, dtype=torch.bfloat16),
                                        value=torch.randn(7, 2, 8, dtype=torch.bfloat16),
                                        slot_mapping=torch.arange(7)))
    assert key != SPEC.validate(**_good(key=torch.randn(8, 2, 8, dtype=torch.bfloat16),
                                        value=torch.randn(8, 2, 8, dtype=torch.bfloat16),
                                        slot_mapping=torch.arange(8)))
    assert not SPEC.validate(**_good(slot_mapping=torch.arange(8)[::2])).slot_mapping_layout.unit_stride
    bf16 = dict(k_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16),
                v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16), k_scale=None, v_scale=None)
    assert key != SPEC.validate(**_good(**bf16))
    assert key != SPEC.validate(**_good(k_scale=None, v_scale=None))
