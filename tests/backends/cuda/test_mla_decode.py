"""The cuda backend's Hopper mla_decode kernel: what it accepts and why not, its compilation for
sm_90a (NVRTC runs on CPU-only machines), and on an sm_90 GPU every head count, q_len, q dtype,
cache kind (q's dtype, fp8 e4m3 with and without a scale), block size and split count against
the spec's reference, with NaN in unread cache slots, NaN-poisoned output memory and CUDA-graph
replays with new inputs."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from cuda_kernels import needs_hopper, needs_nvrtc, poison_allocator
from graph_replay import build, capture, replay_on_new_inputs
from fakes import ask
from kernelmux.backends.cuda import _compile, _paged_decode, _toolchain
from kernelmux.backends.cuda._toolchain import KERNELS
from kernelmux.backends.cuda import mla_decode as mla
from kernelmux.engine import Engine, Settings
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import mla_decode as mla_spec

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
NAMES = ([f"mla_decode_sm90<{q}, {fp8}>" for q in ("true", "false") for fp8 in ("true", "false")]
         + [f"merge_splits<512, {mla.MERGE_GROUPS}, {q}>" for q in ("true", "false")])


# ---------------------------------------------------------------------------------------------
# Host side (any machine)

@pytest.mark.parametrize("kwargs, reason", [
    (dict(q_dtype=torch.float32, cache_dtype=torch.float32), "bf16 or fp16 q only"),
    (dict(cache_dtype=FP16), "a cache of q's dtype (torch.bfloat16) or fp8 e4m3 only, this cache is "
                             "torch.float16"),
    (dict(q_dtype=FP16, cache_dtype=BF16), "or fp8 e4m3 only, this cache is torch.bfloat16"),
    (dict(width=192, rank=128), "rows of 576 with kv_lora_rank 512 only"),
    (dict(rank=448), "got 576 and 448"),
    (dict(block_size=16), "multiple of 64 positions only, got 16"),
    (dict(block_size=96), "got 96"),
])
def test_shape_reason_names_what_it_refuses(kwargs, reason):
    call = dict(q_dtype=BF16, cache_dtype=BF16, width=576, rank=512, block_size=64)
    assert mla.shape_reason(**call) is None
    call.update(kwargs)
    assert reason in mla.shape_reason(**call)


@pytest.mark.parametrize("dtype, block_size", [(BF16, 64), (FP16, 64), (BF16, 128), (BF16, 256)])
def test_shape_reason_takes_deepseek_shapes(dtype, block_size):
    assert mla.shape_reason(dtype, dtype, 576, 512, block_size) is None
    assert mla.shape_reason(dtype, FP8, 576, 512, block_size) is None


def test_split_count_on_the_goal_shapes():
    # One CTA per SM (226 KiB of shared memory), 132 SMs on an H100. B 64 and 128 at 128 heads:
    # 128 and 256 CTAs, no split (two splits of B 64 would take two waves). B 8: 16 CTAs, 8 splits.
    def splits(ctas, max_seq_len=4096):
        return _paged_decode.split_count(ctas, 132, max_seq_len, min_split_len=mla.MIN_SPLIT_LEN,
                                     max_splits=mla.MAX_SPLITS)
    assert splits(128) == 1 and splits(256) == 1
    assert splits(16) == 8
    assert splits(1, 32768) == 64  # capped by MAX_SPLITS (a share of 512 positions)
    assert splits(16, 300) == 1  # shares would be shorter than MIN_SPLIT_LEN


def test_override_plan_checks_its_argument():
    for bad in (0, 65, 2.0, "4"):
        with pytest.raises(ValueError, match=r"num_splits must be an int in \[1, 64\] or None, got"):
            with mla.override_plan(num_splits=bad):
                pass
    with mla.override_plan(num_splits=3):
        assert mla._plans.current == mla.MlaPlan(3)
    assert mla._plans.current == mla.DEFAULT_PLAN


def test_shared_memory_fits_hopper():
    # sm_90's opt-in limit per CTA is 227 KiB; the .cu file's kSharedBytes must equal SHARED_BYTES
    # (the kernel traps on the GPU when launched with less, which the GPU tests would show).
    assert mla.SHARED_BYTES <= 227 * 1024
    source = (KERNELS / mla.SOURCE_NAME).read_text()
    assert "constexpr int kQScale = kStats + 2 * kHeads * 4, kQMaxima = kQScale + 16;" in source
    assert "constexpr int kSharedBytes = kQMaxima + 16 + 1024;" in source
    assert mla.SHARED_BYTES == 3 * (576 // 64) * 64 * 128 + 64 * 128 + 2 * 64 * 4 + 2 * 16 + 1024


@needs_nvrtc
def test_kernels_compile_for_sm90a_without_spills():
    module = _compile.compile_module(mla.source(NAMES[:4], NAMES[4:]), NAMES, (9, 0), verbose=True, arch_specific=True)
    for name in NAMES:
        assert module.spill_bytes(name) == 0, name
        assert 0 < module.registers(name) <= 255, name
    # ptxas reports wgmma it had to serialize (each waiting for the one before) as a "Potential
    # Performance Loss": a branch on a warpgroup index the compiler cannot prove warp-uniform
    # around the MMAs did that once (the kernel takes it from a lane-0 shuffle).
    assert "Performance Loss" not in module.log, module.log


@needs_nvrtc
def test_sm90_without_the_arch_suffix_is_refused_by_ptxas():
    # wgmma needs sm_90a: the plain target must fail, which is why mla_decode.py asks for arch_specific.
    with pytest.raises(_toolchain.NvrtcError, match="sm_90"):
        _compile.compile_module(mla.source(NAMES[:1], []), NAMES[:1], (9, 0))


# ---------------------------------------------------------------------------------------------
# The kernel (sm_90 GPU)

def _check(kwargs, seed):
    assert ask(mla.supports, mla_spec.SPEC, kwargs) is None
    expected = mla_spec.SPEC.reference(**kwargs)
    q = kwargs["q"]
    poison_allocator(q.shape[0] * q.shape[1] * mla.RANK * 4 * 8)
    actual = mla.mla_decode(**kwargs)
    try:
        mla_spec.SPEC.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


# Lengths 1, under one step, exactly one and two steps, across steps and blocks; one sequence
# without a query.
Q_LENS, KV_LENS = (1, 1, 1, 0, 1, 1, 1), (1, 63, 64, 9, 128, 300, 1029)


# The cache: q's dtype, or fp8 e4m3 with and without a scale.
CACHES = {"same": {}, "fp8_scaled": {"cache_dtype": FP8, "kv_scale": 0.23}, "fp8": {"cache_dtype": FP8}}


@needs_hopper
@pytest.mark.parametrize("num_heads", [128, 16, 100])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("cache", CACHES)
def test_decode_against_reference(num_heads, dtype, block_size, return_lse, cache):
    seed = num_heads + block_size + (dtype == FP16)
    make = mla_spec._maker(Q_LENS, KV_LENS, num_heads, block_size=block_size, dtype=dtype,
                           return_lse=return_lse, scale=mla_spec.DEEPSEEK_V3_SCALE, **CACHES[cache])
    _check(build(make, seed, DEVICE), seed)


@needs_hopper
@pytest.mark.parametrize("q_lens, kv_lens", [
    ((2,) * 4, (2, 70, 129, 1000)), ((4, 1, 3), (4, 300, 65)), ((3, 0, 2), (500, 7, 64)),
], ids=["mtp2", "mtp_mixed", "mtp_empty"])
@pytest.mark.parametrize("num_heads", [128, 16])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("cache", ["same", "fp8_scaled"])
def test_mtp_against_reference(q_lens, kv_lens, num_heads, splits, cache):
    seed = 7 * num_heads + sum(kv_lens)
    make = mla_spec._maker(q_lens, kv_lens, num_heads, scale=mla_spec.DEEPSEEK_V3_SCALE, **CACHES[cache])
    with mla.override_plan(num_splits=splits):
        _check(build(make, seed, DEVICE), seed)


@needs_hopper
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 17, 64])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cache", ["same", "fp8_scaled"])
def test_every_split_count_against_reference(splits, dtype, cache):
    # 17 and 64 splits leave empty splits on the short sequences (1029 positions: 17 steps).
    seed = splits
    make = mla_spec._maker(Q_LENS, KV_LENS, 128, dtype=dtype, scale=mla_spec.DEEPSEEK_V3_SCALE,
                           **CACHES[cache])
    with mla.override_plan(num_splits=splits):
        _check(build(make, seed, DEVICE), seed)


@needs_hopper
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_nan_in_unread_slots_is_never_read(splits, cache):
    make = mla_spec._maker((1, 1, 2), (13, 100, 77), 128, nan_in_unused=True, spare_blocks=4, **CACHES[cache])
    with mla.override_plan(num_splits=splits):
        _check(build(make, 5, DEVICE), 5)


@needs_hopper
@pytest.mark.parametrize("cache", ["same", "fp8_scaled"])
def test_goal_shape_against_reference(cache):
    # DeepSeek-V3 B 16 x 4096 at 128 heads (the bench's shape at a quarter of the batch).
    make = mla_spec._deepseek(16, 4096, 128, **CACHES[cache])
    _check(build(make, 11, DEVICE), 11)


@needs_hopper
@pytest.mark.parametrize("cache", ["same", "fp8_scaled"])
def test_cache_with_padded_rows_against_reference(cache):
    # Rows 16 elements apart beyond their 576 (bytes for fp8): every cache read must follow the
    # row stride it is given (cp.async tiles, and fetch_fp8_tile in mla_decode_sm90.cu).
    kwargs = build(mla_spec._maker(Q_LENS, KV_LENS, 128, scale=mla_spec.DEEPSEEK_V3_SCALE, **CACHES[cache]), 3,
                   DEVICE)
    packed = kwargs["kv_cache"]
    padded = torch.zeros(packed.shape[:-1] + (592,), dtype=packed.dtype, device=DEVICE)
    padded[..., :576] = packed
    kwargs["kv_cache"] = padded[..., :576]
    assert kwargs["kv_cache"].stride(1) == 592
    _check(kwargs, 3)


@needs_hopper
@pytest.mark.parametrize("magnitude", [2.0**20, 2.0**-30, 0.0], ids=["large", "tiny", "zero"])
def test_bf16_q_over_fp8_cache_at_extreme_magnitudes(magnitude):
    # A bf16 q over an fp8 cache is converted to fp16 under a power-of-two scale chosen per head tile
    # (mla_decode_sm90.cu, q_tile_to_f16): fp16 alone would overflow at 2^20 and flush 2^-30 to zero.
    # No lse at 2^20: scores of ~1e7 summed from terms that cancel carry fp32 summation-order errors
    # of ~4e-5 relative in any kernel and in the reference, beyond the spec's lse rtol of 1e-5.
    kwargs = build(mla_spec._maker(Q_LENS, KV_LENS, 100, scale=mla_spec.DEEPSEEK_V3_SCALE,
                                   return_lse=magnitude < 1, **CACHES["fp8_scaled"]), 13, DEVICE)
    kwargs["q"] = (kwargs["q"].float() * magnitude).to(BF16)
    _check(kwargs, 13)


@needs_hopper
def test_empty_batch():
    kwargs = build(mla_spec._maker((), (), 128), 0, DEVICE)
    out, lse = mla.mla_decode(**kwargs)
    assert out.shape == (0, 128, 512) and lse.shape == (0, 128)


@needs_hopper
def test_misaligned_q_view_is_refused_by_name():
    kwargs = build(mla_spec._maker((1,), (40,), 128), 1, DEVICE)
    wide = torch.zeros(kwargs["q"].shape[:-1] + (584,), dtype=BF16, device=DEVICE)
    kwargs["q"] = wide[..., 4:580]
    reason = ask(mla.supports, mla_spec.SPEC, kwargs)
    assert reason is not None and reason.startswith("q needs a unit stride along the row and 16-byte aligned")
    # Dispatch decides per key, which holds the layout: the call goes elsewhere, and is right.
    expected = mla_spec.SPEC.reference(**kwargs)
    engine = Engine(ALL_SPECS, Settings())
    mla_spec.SPEC.check_close(engine.dispatchers["mla_decode"](**kwargs), expected, kwargs)
    (decision,) = engine.dispatchers["mla_decode"].decisions.values()
    assert decision.backend != "cuda" and dict(decision.answers)["cuda"] == reason


@needs_hopper
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("cache", ["same", "fp8_scaled"])
def test_decode_graph_replays_new_inputs(splits, cache):
    batch, max_len = 8, 1024
    make = mla_spec._maker((1,) * batch, (max_len,) * batch, 128, scale=mla_spec.DEEPSEEK_V3_SCALE,
                           spare_blocks=16, **CACHES[cache])
    static = build(make, 0, DEVICE)
    with mla.override_plan(num_splits=splits):
        graph, result = capture(mla.mla_decode, static)
        replay_on_new_inputs(mla_spec, make, static, graph, result, batch, max_len)
