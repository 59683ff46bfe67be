"""The triton backend's kv_cache_write against the spec's reference, byte for byte, compiled on a GPU
or interpreted on CPU tensors: support, launch configuration, cases, poisoned caches, layouts,
tiles, drawn shapes (the fp8 codes over every input value: test_kv_cache_write_fp8.py)."""

import contextlib
import importlib
import inspect
import math
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")

from conftest import DEVICE  # noqa: E402
from fakes import ask  # noqa: E402
from kernelmux.backends.triton import kv_cache_write as host  # noqa: E402
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.backends.triton.kv_cache_write import (  # noqa: E402
    MAX_PADDED_HEAD_DIM,
    MAX_TILE,
    LaunchConfig,
    force_software_fp8,
    kv_cache_write,
    launch_config,
    native_fp8_cast,
    override_launch_config,
    supports,
    tile_shape,
)
from kernelmux.specs import kv_cache_write as spec_module  # noqa: E402
from kernelmux.specs.kv_cache_write import SPEC, quantize_to_cache_fp8  # noqa: E402

ON_GPU = DEVICE == "cuda"
FP8 = torch.float8_e4m3fn

if not ON_GPU and not isinstance(
    host._kernel(), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )

# The interpreter evaluates the integer fp8 route on NaN and inf lanes too (their codes are then
# replaced), and numpy warns about the arithmetic; the results are checked byte for byte below.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

SEEDS = (0, 1)
# The interpreter's cost is per program (~10 ms), not per element: above this many tokens the spec
# cases run with one wide block per program (the heuristic's configs are covered by
# test_each_launch_config and, compiled, on the GPU).
INTERPRETER_MAX_TOKENS = 64
INTERPRETER_WIDE_CONFIG = LaunchConfig(block_t=256, num_warps=4)

# The fp8 routes a device can run: the integer route everywhere; the hardware cast on CUDA
# devices of compute capability >= 8.9 only (the interpreter's own cast is wrong, see
# _kv_cache_write_kernel.py, so the native route is never launched there).
ROUTES = ["software", "native"]


def _run(kwargs: dict) -> None:
    """The kernel, with one wide block per program for big batches under the interpreter."""
    if ON_GPU or kwargs["key"].shape[0] <= INTERPRETER_MAX_TOKENS:
        assert kv_cache_write(**kwargs) is None
        return
    with override_launch_config(INTERPRETER_WIDE_CONFIG):
        assert kv_cache_write(**kwargs) is None


def _clone(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _check(kwargs: dict, seed: int = 0) -> None:
    """Run the kernel on ``kwargs`` and the reference on a copy; both whole caches compared as
    bytes (written slots and untouched ones)."""
    assert ask(supports, SPEC, kwargs) is None
    expected = _clone(kwargs)
    SPEC.reference(**expected)
    _run(kwargs)
    try:
        SPEC.check_close(SPEC.outputs(None, kwargs), SPEC.outputs(None, expected), kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def _route(route: str):
    """Context for an fp8 route; skips the native one where the device has no hardware cast."""
    if route == "software":
        return force_software_fp8()
    if not native_fp8_cast(torch.device(DEVICE)):
        pytest.skip(
            "GPU only: the native fp8 route needs a CUDA device of compute capability >= 8.9 "
            "(on CPU the interpreter's fp32 -> fp8 cast is not round-to-nearest-even)"
        )
    return force_software_fp8(False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Signature, support, configuration


def test_signatures_match_the_spec() -> None:
    assert inspect.signature(kv_cache_write) == SPEC.signature
    assert list(inspect.signature(supports).parameters) == ["key", "platform"]


def test_supports_limits() -> None:
    kwargs = SPEC.case("small_fp16_padding").build("cpu", 0)
    assert ask(supports, SPEC, kwargs) is None
    # Only the shapes matter: meta tensors stand for a head dim too wide for one tile.
    platform = simulate("sm_90")
    for head_dim, refused in ((MAX_PADDED_HEAD_DIM + 1, True), (MAX_PADDED_HEAD_DIM, False)):
        rows = torch.empty(1, 1, head_dim, dtype=torch.bfloat16, device="meta")
        cache = torch.empty(2, 4, 1, head_dim, dtype=torch.bfloat16, device="meta")
        slots = torch.empty(1, dtype=torch.int64, device="meta")
        reason = ask(supports, SPEC, dict(key=rows, value=rows, k_cache=cache, v_cache=cache, slot_mapping=slots),
                     platform)
        assert (reason is not None) == refused
        if refused:
            assert str(MAX_PADDED_HEAD_DIM + 1) in reason


def test_tile_shape() -> None:
    assert tile_shape(8, 128) == (8, 128)  # Llama-3-8B: the whole row, no padding
    assert tile_shape(3, 40) == (4, 64)  # padded heads and dims
    assert tile_shape(64, 128) == (MAX_TILE // 128, 128)  # MHA: head chunks of 32
    assert tile_shape(1, MAX_PADDED_HEAD_DIM) == (1, MAX_PADDED_HEAD_DIM)


def test_launch_config_heuristic_and_override() -> None:
    # One 16-byte vector per thread for bf16 rows of 8 x 128: 1024 elements over 4 warps.
    assert launch_config(8, 128, 2) == LaunchConfig(block_t=1, num_warps=4)
    assert launch_config(1, 128, 2) == LaunchConfig(block_t=2, num_warps=1)  # 70B at TP8
    assert launch_config(32, 128, 2) == LaunchConfig(block_t=1, num_warps=8)
    assert launch_config(64, 128, 2) == LaunchConfig(block_t=1, num_warps=8)  # head chunks
    assert launch_config(1, 8, 2) == LaunchConfig(block_t=16, num_warps=1)  # capped tokens
    sweep = LaunchConfig(block_t=4, num_warps=2)
    outer = LaunchConfig(block_t=8, num_warps=1)
    with override_launch_config(outer):
        with override_launch_config(sweep):
            assert launch_config(8, 128, 2) == sweep
        assert launch_config(8, 128, 2) == outer
    assert launch_config(8, 128, 2) == LaunchConfig(block_t=1, num_warps=4)
    with pytest.raises(ValueError, match="power of two"):
        with override_launch_config(LaunchConfig(block_t=3, num_warps=1)):
            pass
    with pytest.raises(AttributeError):
        sweep.block_t = 2  # frozen


def test_native_fp8_cast_choice() -> None:
    assert native_fp8_cast(torch.device("cpu")) is False
    with force_software_fp8():
        assert native_fp8_cast(torch.device(DEVICE)) is False
        with force_software_fp8(False):
            assert native_fp8_cast(torch.device(DEVICE)) is (
                ON_GPU and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)
                and os.environ.get("TRITON_INTERPRET", "") != "1"
            )
        assert native_fp8_cast(torch.device(DEVICE)) is False


# ---------------------------------------------------------------------------------------------
# The spec's cases


# fp8 cases run once per route; bf16/fp16 caches are copied, with no route to choose.
CASE_PARAMS = [
    pytest.param(case, route, id=f"{case.name}-{route}")
    for case in SPEC.cases
    for route in (ROUTES if case.build("cpu", 0)["k_cache"].dtype == FP8 else ["copy"])
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case, route", CASE_PARAMS)
def test_spec_case(case, route: str, seed: int) -> None:
    kwargs = case.build(DEVICE, seed)
    with _route(route) if route != "copy" else contextlib.nullcontext():
        _check(kwargs, seed)


def test_empty_batch_launches_nothing(monkeypatch) -> None:
    kwargs = SPEC.case("empty").build(DEVICE, 0)
    before = _clone(kwargs)

    def no_launch():
        raise AssertionError("T = 0 must not launch the kernel")

    monkeypatch.setattr(host, "_kernel", no_launch)
    assert kv_cache_write(**kwargs) is None
    assert torch.equal(_bytes(kwargs["k_cache"]), _bytes(before["k_cache"]))
    assert torch.equal(_bytes(kwargs["v_cache"]), _bytes(before["v_cache"]))


# ---------------------------------------------------------------------------------------------
# Poisoned caches, padding, special values


def _poisoned_cache(shape, cache_dtype, generator) -> torch.Tensor:
    """NaN everywhere (bf16/fp16), or random bytes including NaN codes (fp8)."""
    if cache_dtype == FP8:
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).view(FP8)
    return torch.full(shape, float("nan"), dtype=cache_dtype)


@pytest.mark.parametrize(
    "cache_dtype, route",
    [(torch.bfloat16, "copy"), (torch.float16, "copy")] + [(FP8, route) for route in ROUTES],
    ids=lambda p: str(p).replace("torch.", ""),
)
def test_poisoned_caches_keep_untouched_slots(cache_dtype: torch.dtype, route: str) -> None:
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    num_blocks, block_size, heads, dim = 6, 4, 3, 24
    shape = (num_blocks, block_size, heads, dim)
    # Padding of several values (any negative is padding), the first and last slot written.
    slots = torch.tensor([5, -1, 23, 0, -8, 17, -(2**62), 9, -1], dtype=torch.int64)
    key = torch.randn(slots.numel(), heads, dim, generator=gen).to(dtype)
    value = torch.randn(slots.numel(), heads, dim, generator=gen).to(dtype)
    kwargs = {
        "key": key.to(DEVICE),
        "value": value.to(DEVICE),
        "k_cache": _poisoned_cache(shape, cache_dtype, gen).to(DEVICE),
        "v_cache": _poisoned_cache(shape, cache_dtype, gen).to(DEVICE),
        "slot_mapping": slots.to(DEVICE),
        "k_scale": torch.tensor(0.37, device=DEVICE) if cache_dtype == FP8 else None,
        "v_scale": torch.tensor([0.011], device=DEVICE) if cache_dtype == FP8 else None,
    }
    before = _clone(kwargs)
    with _route(route) if route != "copy" else contextlib.nullcontext():
        _check(kwargs)
    written = set(slots[slots >= 0].tolist())
    for cache, old in ((kwargs["k_cache"], before["k_cache"]), (kwargs["v_cache"], before["v_cache"])):
        now_bytes = _bytes(cache).view(num_blocks * block_size, -1)
        old_bytes = _bytes(old).view(num_blocks * block_size, -1)
        for slot in range(num_blocks * block_size):
            if slot not in written:
                assert torch.equal(now_bytes[slot], old_bytes[slot]), f"slot {slot} was touched"
            else:
                assert not torch.equal(now_bytes[slot], old_bytes[slot]), f"slot {slot} not written"


def test_copy_keeps_nan_payloads_and_signed_zeros() -> None:
    # bf16/fp16 caches hold the key's bits: NaNs of either sign and payload, infinities, -0.0.
    patterns = [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8001]
    for dtype, nan_patterns in ((torch.bfloat16, patterns), (torch.float16, [0x7E00, 0xFE00, 0x7C01,
                                                                              0xFFFF, 0x7C00, 0xFC00,
                                                                              0x8000, 0x0001, 0x8001])):
        bits = torch.tensor(nan_patterns, dtype=torch.int32).to(torch.int16)
        key = bits.view(dtype).reshape(1, 1, -1).to(DEVICE)
        kwargs = {
            "key": key,
            "value": key.flip(-1),
            "k_cache": torch.zeros(2, 2, 1, key.shape[-1], dtype=dtype, device=DEVICE),
            "v_cache": torch.zeros(2, 2, 1, key.shape[-1], dtype=dtype, device=DEVICE),
            "slot_mapping": torch.tensor([3], device=DEVICE),
            "k_scale": None,
            "v_scale": None,
        }
        _check(kwargs)
        assert torch.equal(kwargs["k_cache"][1, 1, 0].cpu().view(torch.int16), bits)


# ---------------------------------------------------------------------------------------------
# Layouts: strided keys and values, views of bigger caches


def _fused_qkv(key: torch.Tensor, value: torch.Tensor, num_q_heads: int = 3):
    """key and value as slices of one NaN-padded [T, (Hq + 2 Hkv) * D] qkv projection output."""
    tokens, heads, dim = key.shape
    q = num_q_heads * dim
    qkv = torch.full((tokens, q + 2 * heads * dim), float("nan"), dtype=key.dtype, device=key.device)
    qkv[:, q : q + heads * dim] = key.reshape(tokens, heads * dim)
    qkv[:, q + heads * dim :] = value.reshape(tokens, heads * dim)
    key_view = qkv[:, q : q + heads * dim].view(tokens, heads, dim)
    return key_view, qkv[:, q + heads * dim :].view(tokens, heads, dim)


def _dim_strided(x: torch.Tensor) -> torch.Tensor:
    """x stored as [T, D, Hkv]: the head dim's stride is Hkv (no unit stride anywhere but heads)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


KEY_LAYOUTS = ["contiguous", "fused_qkv", "dim_strided", "mixed"]


def _key_views(key: torch.Tensor, value: torch.Tensor, layout: str):
    if layout == "contiguous":
        return key, value
    if layout == "fused_qkv":
        return _fused_qkv(key, value)
    if layout == "dim_strided":
        return _dim_strided(key), _dim_strided(value)
    if layout == "mixed":  # key a fused-qkv slice, value dim-strided: every stride differs
        return _fused_qkv(key, value)[0], _dim_strided(value)
    raise ValueError(layout)


def _cache_views(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str):
    """The caches as views of other storage, and that storage (to check nothing outside the views
    was written)."""
    num_blocks, block_size, heads, dim = k_cache.shape
    if layout == "joint":  # vLLM's FlashAttention layout: [2, num_blocks, block_size, Hkv, D]
        storage = torch.stack([k_cache, v_cache])
        return storage[0], storage[1], storage
    if layout == "joint_blocks_outer":  # FlashInfer's: [num_blocks, 2, block_size, Hkv, D]
        storage = torch.stack([k_cache, v_cache], dim=1)
        return storage[:, 0], storage[:, 1], storage
    if layout == "padded_heads":  # head stride D + 5, with poison between heads
        storage = torch.full((2, num_blocks, block_size, heads, dim + 5), float("nan"),
                             device=k_cache.device).to(k_cache.dtype)
        storage[0, ..., :dim] = k_cache
        storage[1, ..., :dim] = v_cache
        return storage[0, ..., :dim], storage[1, ..., :dim], storage
    if layout == "head_major":  # stored [num_blocks, Hkv, block_size, D], permuted
        storage = torch.stack([k_cache, v_cache]).transpose(2, 3).contiguous()
        return storage[0].transpose(1, 2), storage[1].transpose(1, 2), storage
    if layout == "mixed":  # K plain, V head-major in a storage of its own: different strides
        storage = v_cache.transpose(1, 2).contiguous()
        return k_cache, storage.transpose(1, 2), None
    raise ValueError(layout)


CACHE_LAYOUTS = ["joint", "joint_blocks_outer", "padded_heads", "head_major", "mixed"]


@pytest.mark.parametrize("cache_layout", ["plain"] + CACHE_LAYOUTS)
@pytest.mark.parametrize("key_layout", KEY_LAYOUTS)
@pytest.mark.parametrize("case_name", ["small_fp16_padding", "small_fp8_scales"])
def test_strided_inputs_and_caches(case_name: str, key_layout: str, cache_layout: str) -> None:
    kwargs = SPEC.case(case_name).build(DEVICE, 5)
    kwargs["key"], kwargs["value"] = _key_views(kwargs["key"], kwargs["value"], key_layout)
    storage = None
    if cache_layout != "plain":
        kwargs["k_cache"], kwargs["v_cache"], storage = _cache_views(
            kwargs["k_cache"], kwargs["v_cache"], cache_layout
        )
        assert not (kwargs["k_cache"].is_contiguous() and kwargs["v_cache"].is_contiguous()) or (
            cache_layout == "joint"
        )
    storage_before = storage.clone() if storage is not None else None
    _check(kwargs)
    if storage is not None:
        # Bytes outside the two views (padding between heads) are unchanged: mark the views'
        # elements through a flat index map of the storage.
        index = torch.arange(storage.numel(), device=storage.device).view(storage.shape)
        inside = torch.zeros(storage.numel(), dtype=torch.bool, device=storage.device)
        for cache in (kwargs["k_cache"], kwargs["v_cache"]):
            offset = cache.storage_offset() - storage.storage_offset()
            view = index.flatten()[offset:].as_strided(cache.shape, cache.stride())
            inside[view.flatten()] = True
        outside = ~inside.view(storage.shape)
        assert torch.equal(_bytes(storage[outside]), _bytes(storage_before[outside]))


# ---------------------------------------------------------------------------------------------
# Tiles: head chunks, padding lanes, every launch configuration


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("heads,dim", [(5, 1024), (16, 512), (3, 40), (1, 1), (7, 3)])
def test_head_chunks_and_padded_tiles(heads: int, dim: int, cache_dtype: torch.dtype) -> None:
    # (5, 1024): two head chunks of 4, the second with 3 padding heads; (16, 512): two full chunks.
    block_h, block_d = tile_shape(heads, dim)
    assert math.ceil(heads / block_h) == (2 if dim >= 512 else 1)
    make = spec_module._maker(5, heads, dim, 3, 4, cache_dtype=cache_dtype, padding=0.2,
                              scales=(0.2, 0.9) if cache_dtype == FP8 else None, magnitude=40.0)
    kwargs = make(torch.device("cpu"), torch.Generator().manual_seed(6))
    _check({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


LAUNCH_CONFIGS = [LaunchConfig(block_t=t, num_warps=w) for t in (1, 2, 4, 16) for w in (1, 4, 8)]


@pytest.mark.parametrize("config", LAUNCH_CONFIGS, ids=lambda c: f"bt{c.block_t}w{c.num_warps}")
@pytest.mark.parametrize("case_name", ["small_fp16_padding", "small_fp8_scales"])
def test_each_launch_config(case_name: str, config: LaunchConfig) -> None:
    # 37 and 23 tokens: partial last programs for every block_t > 1.
    kwargs = SPEC.case(case_name).build(DEVICE, 7)
    with override_launch_config(config):
        _check(kwargs)


@pytest.mark.skipif(
    not ON_GPU,
    reason="GPU only: caches of over 2**31 elements (2 GiB each in fp8) to reach the int64 offsets",
)
def test_offsets_past_2_to_the_31() -> None:
    heads, dim, block_size = 8, 128, 16
    per_block = block_size * heads * dim
    num_blocks = 2**31 // per_block + 8
    shape = (num_blocks, block_size, heads, dim)
    k_cache = torch.zeros(shape, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=FP8, device=DEVICE)
    last = num_blocks * block_size - 1
    slots = torch.tensor([last, 3, last - 17, -1, (2**31 // (heads * dim)) + 1], device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    key = torch.randn(slots.numel(), heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(slots.numel(), heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    scale = torch.tensor(0.05, device=DEVICE)
    kv_cache_write(key, value, k_cache, v_cache, slots, scale, None)
    flat_k = k_cache.view(-1, heads, dim)
    flat_v = v_cache.view(-1, heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(_bytes(flat_k[slot]), _bytes(quantize_to_cache_fp8(key[t], scale))), slot
        assert torch.equal(_bytes(flat_v[slot]), _bytes(quantize_to_cache_fp8(value[t], None))), slot
    # Nothing else was written: at most the 4 written rows hold non-zero codes.
    assert int((k_cache.view(torch.uint8) != 0).sum()) <= 4 * heads * dim
    assert int((v_cache.view(torch.uint8) != 0).sum()) <= 4 * heads * dim


@pytest.mark.skipif(not ON_GPU, reason="GPU only: reads the compiled kernel's PTX")
@pytest.mark.parametrize("case_name", ["llama3_8b_decode_b256", "llama3_8b_fp8_prefill_t1024"])
def test_row_accesses_are_16_byte_vectors(case_name: str) -> None:
    # The perf goal of a memory-bound copy: K and V rows (8 x 128 bf16) read with ld.global.v4.b32
    # (16 bytes) and written with st.global.v4.b32 (bf16) or st.global.v2.b32 (8 fp8 codes).
    kwargs = SPEC.case(case_name).build(DEVICE, 0)
    compiled = host._launch(**kwargs)
    ptx = compiled.asm["ptx"]
    loads = re.findall(r"ld\.global[.\w:]*", ptx)
    stores = re.findall(r"st\.global[.\w:]*", ptx)
    fp8 = kwargs["k_cache"].dtype == FP8
    assert any(".v4.b32" in op for op in loads), loads
    assert not any(op.endswith(".b16") for op in loads), loads  # no element-wise row loads
    wide_stores = (".v2.b32", ".v4.b32") if fp8 else (".v4.b32",)  # fp8: 8 codes a thread at least
    assert any(width in op for op in stores for width in wide_stores), stores
    assert not any(op.endswith(".b16") or op.endswith(".b8") for op in stores), stores


# ---------------------------------------------------------------------------------------------
# Drawn shapes and layouts


@st.composite
def drawn_calls(draw):
    block_size = draw(st.sampled_from([1, 2, 5, 16]))
    tokens = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 33, 48]))
    num_blocks = max(1, -(-tokens // block_size)) + draw(st.integers(0, 3))
    cache_fp8 = draw(st.booleans())
    return dict(
        maker=dict(
            tokens=tokens,
            num_kv_heads=draw(st.integers(1, 6)),
            head_dim=draw(st.sampled_from([1, 3, 8, 40, 64, 96, 128, 136, 200])),
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
            cache_dtype=FP8 if cache_fp8 else None,
            padding=draw(st.sampled_from([0.0, 0.3, 1.0])),
            scales=(
                (draw(st.floats(2.0**-10, 10.0, width=32)), draw(st.floats(2.0**-10, 10.0, width=32)))
                if cache_fp8 and draw(st.booleans()) else None
            ),
            magnitude=draw(st.sampled_from([1.0, 100.0])),
        ),
        key_layout=draw(st.sampled_from(KEY_LAYOUTS)),
        cache_layout=draw(st.sampled_from(["plain"] + CACHE_LAYOUTS)),
    )


@given(call=drawn_calls(), seed=st.integers(0, 2**32 - 1))
def test_drawn_shapes(call, seed: int) -> None:
    kwargs = spec_module._maker(**call["maker"])(torch.device("cpu"), torch.Generator().manual_seed(seed))
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    kwargs["key"], kwargs["value"] = _key_views(kwargs["key"], kwargs["value"], call["key_layout"])
    if call["cache_layout"] != "plain":
        kwargs["k_cache"], kwargs["v_cache"], _ = _cache_views(
            kwargs["k_cache"], kwargs["v_cache"], call["cache_layout"]
        )
    _check(kwargs, seed)
