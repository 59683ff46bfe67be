"""The triton backend's fused_moe against the spec's reference, compiled on a GPU or interpreted on CPU
tensors: support, launch configurations, fp4 decoding, every case the kernels serve on fresh seeds, freed memory
poisoned under every output and scratch buffer, strided and sliced inputs, the routing layout on its
own, and on the GPU both fp8 routes and a CUDA-graph replay on new routing."""

import importlib
import inspect

import pytest
import torch

# conftest sets TRITON_INTERPRET=1 on machines without a GPU before any kernel module is imported.
pytest.importorskip("triton", reason="needs triton (pip install kernelmux[test] on Linux x86_64)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from conftest import DEVICE  # noqa: E402
from fakes import ask, check_against_reference  # noqa: E402
from kernelmux.backends.triton import fused_moe as host  # noqa: E402
from kernelmux.backends.triton._host import force_software_fp8, native_fp8_cast  # noqa: E402
from kernelmux.backends.triton.fused_moe import (  # noqa: E402
    GemmConfig,
    LaunchConfig,
    fused_moe,
    launch_config,
    override_launch_config,
    supports,
)
from kernelmux.platforms import simulate  # noqa: E402
from kernelmux.specs.fp4_mm import E2M1_TABLE  # noqa: E402
from kernelmux.specs.fused_moe import SPEC  # noqa: E402
from kernelmux.specs.quantize_mxfp4 import e8m0_to_float  # noqa: E402

ON_GPU = DEVICE == "cuda"
if not ON_GPU and not isinstance(
    getattr(host._kernels(), "moe_down_kernel"), importlib.import_module("triton.runtime.interpreter").InterpretedFunction
):
    pytest.skip(
        "the triton kernel module was imported before TRITON_INTERPRET=1 was set, so it cannot "
        "run on CPU tensors in this process; run this file on its own",
        allow_module_level=True,
    )
KERNELS = host._kernels()
from kernelmux.backends.triton import _fp4_kernel as FP4  # noqa: E402

SERVED = [case.name for case in SPEC.cases
          if "fnuz" not in case.name and (ON_GPU or "gpu" not in case.tags)]
# The interpreter costs ~10 ms per program: on the CPU the model cases (experts of 42-336 MiB, a
# minute per call there) are left to the GPU, and the rest run on one seed (the GPU runs two).
SEEDS = (0, 7) if ON_GPU else (0,)


def _build(name: str, seed: int) -> dict:
    return SPEC.case(name).build(DEVICE, seed)


def _check(kwargs: dict, what: str = "") -> torch.Tensor:
    poison_bytes = 4 * (kwargs["hidden"].numel() + 8 * kwargs["w1"].shape[1] * 64)
    return check_against_reference(SPEC, fused_moe, kwargs, what, poison_bytes)


# ---------------------------------------------------------------------------------------------
# Signature, support, configuration


def test_signatures_match_the_spec() -> None:
    assert inspect.signature(fused_moe) == SPEC.signature
    assert list(inspect.signature(supports).parameters) == ["key", "platform"]


def test_declines_with_reasons() -> None:
    kwargs = SPEC.case("small_fp8_block_fnuz_gelu").build("cpu", 0)
    assert "e4m3fnuz" in ask(supports, SPEC, kwargs, simulate("sm_90"))
    kwargs = SPEC.case("small_fp8_block").build("cpu", 0)
    assert ask(supports, SPEC, kwargs, simulate("sm_90")) is None
    assert "sm_89 or later" in ask(supports, SPEC, kwargs, simulate("sm_80"))
    assert ask(supports, SPEC, SPEC.case("small_silu").build("cpu", 0), simulate("sm_80")) is None
    # W4A16 multiplies in the hidden dtype: no fp8 tensor cores needed.
    assert ask(supports, SPEC, SPEC.case("small_mxfp4").build("cpu", 0), simulate("sm_80")) is None
    # Only the shapes matter: meta tensors stand for more local experts than one program counts.
    for experts, refused in ((host.MAX_EXPERTS + 1, True), (host.MAX_EXPERTS, False)):
        kwargs = dict(hidden=torch.empty(4, 64, dtype=torch.bfloat16, device="meta"),
                      w1=torch.empty(experts, 32, 64, dtype=torch.bfloat16, device="meta"),
                      w2=torch.empty(experts, 64, 16, dtype=torch.bfloat16, device="meta"),
                      topk_weights=torch.empty(4, 2, device="meta"),
                      topk_ids=torch.empty(4, 2, dtype=torch.int32, device="meta"))
        reason = ask(supports, SPEC, kwargs, simulate("sm_90"))
        assert (reason is not None) == refused, reason


def test_the_heuristic_follows_tokens_and_pairs_per_expert() -> None:
    # T = 1 takes the GEMVs for fp4 weights; bf16 and fp8 keep the grouped kernels.
    for quantization in ("mxfp4", "nvfp4"):
        decode = launch_config(1, 4, 128, quantization)  # gpt-oss-120b T = 1
        assert decode.gemv and not decode.tuned, quantization
        assert not launch_config(2, 4, 128, quantization).gemv
    assert not launch_config(1, 8, 256, "fp8_block").gemv
    decode = launch_config(1, 8, 128, "none")  # Qwen3 T = 1
    assert not decode.gemv and decode.block_m == 16
    small = launch_config(64, 8, 128, "none")  # Qwen3 T = 64: 4 pairs per expert
    assert small.block_m == 16 and not small.gemv and not small.tuned
    assert launch_config(4096, 8, 128, "none").block_m == 128
    # fp8_block steps one 128-wide activation group per k-step, and gate-up's tile is one group of
    # the intermediate (its epilogue quantizes it), whatever the tiles say.
    assert launch_config(1, 8, 256, "fp8_block").gate_up.block_k == 128
    with override_launch_config(LaunchConfig(32, GemmConfig(32, 32), GemmConfig(32, 64))):
        config = launch_config(1, 8, 256, "fp8_block")
        assert (config.block_m, config.gate_up.block_k, config.down.block_k) == (32, 128, 128)
        assert (config.gate_up.block_n, config.down.block_n) == (128, 32)


def test_a_gemv_override_serves_the_gemv_quantizations_at_any_size() -> None:
    tiles = GemmConfig(4, 32)
    with override_launch_config(LaunchConfig(16, tiles, tiles, gemv=True)):
        assert launch_config(4096, 8, 128, "none").gemv
        assert launch_config(64, 4, 128, "nvfp4").gemv
        fp8 = launch_config(1, 8, 256, "fp8_block")  # the table's or the heuristic's grouped kernels
        assert not fp8.gemv and fp8.block_m == 16


def test_measured_rows_are_used_on_their_device_and_bucket_only() -> None:
    h200 = "NVIDIA H200"
    small = launch_config(64, 8, 128, "none", h200)  # Qwen3 T = 64
    assert small.tuned and (small.block_m, small.gate_up.block_n, small.gate_up.block_k) == (16, 64, 128)
    assert launch_config(4096, 2, 8, "none", h200).block_m == 128  # Mixtral T = 4096: measured
    assert not launch_config(48, 8, 8, "none", h200).tuned  # 48 pairs per expert: no measured row
    assert not launch_config(64, 8, 128, "none", "NVIDIA H100 80GB HBM3").tuned  # another device
    assert launch_config(1, 8, 256, "fp8_block", h200).tuned
    assert not launch_config(1, 8, 256, "fp8_per_tensor", h200).tuned  # measured for fp8_block only
    gemv = launch_config(1, 4, 128, "mxfp4", h200)  # gpt-oss-120b T = 1
    assert gemv.gemv and gemv.tuned and (gemv.gate_up.block_n, gemv.gate_up.block_k) == (8, 512)
    assert not launch_config(1, 4, 128, "nvfp4", h200).tuned  # measured for mxfp4 only


def test_fp8_steps_keep_the_k_tl_dot_needs() -> None:
    tiles = GemmConfig(32, 16)
    with override_launch_config(LaunchConfig(16, tiles, tiles)):
        assert launch_config(4, 2, 8, "fp8_per_tensor").gate_up.block_k == host.FP8_DOT_MIN_K
        assert launch_config(4, 2, 8, "none").gate_up.block_k == 16


def test_fp4_steps_hold_whole_scale_blocks() -> None:
    tiles = GemmConfig(32, 16)
    for gemv in (False, True):
        with override_launch_config(LaunchConfig(16, tiles, tiles, gemv=gemv)):
            assert launch_config(4, 2, 8, "mxfp4").gate_up.block_k == 32
            assert launch_config(4, 2, 8, "mxfp4").down.block_k == 32
            assert launch_config(4, 2, 8, "nvfp4").gate_up.block_k == 16


@triton.jit
def _decode_codes(codes_ptr, e2m1_ptr, e8m0_ptr, e4m3_ptr):
    i = tl.arange(0, 256)
    codes = tl.load(codes_ptr + i)
    tl.store(e2m1_ptr + i, FP4.e2m1_values(codes.to(tl.int32) & 15))
    tl.store(e8m0_ptr + i, FP4.fp4_scales(codes, FP4.MXFP4))
    tl.store(e4m3_ptr + i, FP4.fp4_scales(codes, FP4.NVFP4))


def test_fp4_decoding_of_every_code() -> None:
    # Every e2m1 code and every scale byte (e8m0: 0 is 2^-127, 0xFF NaN; e4m3fn: subnormals, negatives,
    # NaN), against the spec's decoders and torch's e4m3fn, bit for bit.
    codes = torch.arange(256, dtype=torch.int32, device=DEVICE).to(torch.uint8)
    e2m1, e8m0, e4m3 = (torch.full((256,), 7.0, device=DEVICE) for _ in range(3))
    _decode_codes[(1,)](codes, e2m1, e8m0, e4m3)
    table = torch.tensor(E2M1_TABLE)[torch.arange(256) & 15]
    assert torch.equal(e2m1.cpu(), table) and torch.equal(e2m1.cpu().signbit(), table.signbit())  # 8: -0.0
    torch.testing.assert_close(e8m0.cpu(), e8m0_to_float(codes.cpu()), rtol=0, atol=0, equal_nan=True)
    want = codes.cpu().view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(e4m3.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(e4m3.cpu().signbit()[~want.isnan()], want.signbit()[~want.isnan()])  # 0x80: -0.0


@triton.jit
def _decode_pairs(packed_ptr, scale_ptr, even_ptr, odd_ptr, QUANT: tl.constexpr, HIDDEN: tl.constexpr,
                  BLOCKS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    # [256 rows: one per scale code, BLOCKS blocks of BLOCK_BYTES bytes] -> even and odd k in HIDDEN
    row = tl.arange(0, 256)
    col = tl.arange(0, BLOCKS * BLOCK_BYTES)
    packed = tl.load(packed_ptr + row[:, None] * (BLOCKS * BLOCK_BYTES) + col[None, :])
    scales = tl.load(scale_ptr + row[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :])
    even, odd = FP4.fp4_pairs(packed, scales, QUANT, HIDDEN)
    out = row[:, None] * (BLOCKS * BLOCK_BYTES) + col[None, :]
    tl.store(even_ptr + out, even)
    tl.store(odd_ptr + out, odd)


@pytest.mark.skipif(not ON_GPU, reason="GPU only: the Triton interpreter's bf16 arithmetic is wrong (x * 2 gives 0, "
                                        "bf16 -> fp32 flushes subnormals), so the kernels take the fp32 decoding there")
@pytest.mark.parametrize("quantization, dtype", [("mxfp4", torch.bfloat16), ("nvfp4", torch.bfloat16),
                                                 ("nvfp4", torch.float16)])
def test_fp4_pair_decoding_of_every_byte_under_every_scale(quantization: str, dtype: torch.dtype) -> None:
    # fp4_pairs, the decoding both GEMMs use on the GPU (but MXFP4 with fp16): every packed byte (two nibbles)
    # under every scale byte of the format, in the hidden dtype, against the fp32 product of the spec's
    # decoders rounded to it (exact where it fits: e8m0 0 is a bf16 subnormal, 0xFF NaN), bit for bit.
    block_bytes = 16 if quantization == "mxfp4" else 8
    blocks = 32 // block_bytes  # 32 bytes a row: each byte value in every row, spread over the row's blocks
    packed = (torch.arange(256 * 32) * 37 % 256).to(torch.uint8).view(256, 32)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, blocks).contiguous()
    even, odd = (torch.full((256, 32), 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    _decode_pairs[(1,)](packed.to(DEVICE), scales.to(DEVICE), even, odd, QUANT=getattr(FP4, quantization.upper()),
                        HIDDEN=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, BLOCKS=blocks,
                        BLOCK_BYTES=block_bytes)
    table = torch.tensor(E2M1_TABLE)
    scale = e8m0_to_float(scales) if quantization == "mxfp4" else scales.view(torch.float8_e4m3fn).float()
    scale = scale.repeat_interleave(block_bytes, dim=1)
    for name, got, nibble in (("even", even, packed.long() & 15), ("odd", odd, packed.long() >> 4)):
        want = (table[nibble] * scale).to(dtype)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True, msg=f"{name} k")
        number = ~want.isnan()  # a NaN's sign is the device's
        assert torch.equal(got.cpu().signbit()[number], want.signbit()[number]), f"{name} k: signs"


def test_describe_names_the_configuration_and_its_source() -> None:
    kwargs = SPEC.case("small_mxfp4").build("cpu", 0)
    kwargs = {**kwargs, "hidden": kwargs["hidden"][:1], "topk_weights": kwargs["topk_weights"][:1],
              "topk_ids": kwargs["topk_ids"][:1]}
    key = SPEC.validate(**kwargs)
    text = host.describe(key, simulate("sm_90"))
    config = launch_config(1, key.topk, key.num_global_experts, key.quantization)
    assert text.startswith(f"at T = 1: decode GEMVs; gate-up BN {config.gate_up.block_n}")
    assert "heuristic" in text
    key = SPEC.validate(**SPEC.case("small_silu").build("cpu", 0))
    config = launch_config(key.num_tokens_class, key.topk, key.num_global_experts, key.quantization)
    text = host.describe(key, simulate("sm_90"))
    assert text.startswith(f"at T = {key.num_tokens_class}: BLOCK_M {config.block_m}; gate-up BN")


def test_an_invalid_override_is_refused() -> None:
    with pytest.raises(ValueError, match="block_m = 24"):
        with override_launch_config(LaunchConfig(24, GemmConfig(32, 32), GemmConfig(32, 32))):
            pass
    with pytest.raises(ValueError, match="reduce = 'scatter'"):
        with override_launch_config(LaunchConfig(16, GemmConfig(32, 32), GemmConfig(32, 32), reduce="scatter")):
            pass
    with pytest.raises(ValueError, match="powers of two >= 16"):
        with override_launch_config(LaunchConfig(16, GemmConfig(8, 32), GemmConfig(32, 32))):
            pass
    with pytest.raises(ValueError, match="GEMVs' tiles are powers of two"):
        with override_launch_config(LaunchConfig(16, GemmConfig(6, 32), GemmConfig(32, 32), gemv=True)):
            pass
    with override_launch_config(LaunchConfig(16, GemmConfig(1, 32), GemmConfig(8, 16), gemv=True)):
        pass  # narrower than tl.dot's tiles: the GEMVs take any power of two


# ---------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("seed", SEEDS)
def test_cases_match_the_reference(name: str, seed: int) -> None:
    if not ON_GPU and "model" in SPEC.case(name).tags:
        pytest.skip(f"GPU only: {name}'s experts take about a minute per call under the Triton interpreter")
    kwargs = _build(name, seed)
    assert ask(supports, SPEC, kwargs) is None
    _check(kwargs, f"{name}, seed {seed}")


@pytest.mark.parametrize("config", [
    LaunchConfig(16, GemmConfig(16, 32, group_m=1), GemmConfig(32, 16, group_m=2), reduce="atomic"),
    LaunchConfig(32, GemmConfig(64, 64, group_m=4), GemmConfig(16, 128, group_m=1)),
    LaunchConfig(64, GemmConfig(32, 16, group_m=8), GemmConfig(64, 32, group_m=8), reduce="atomic"),
], ids=lambda c: (f"m{c.block_m}-n{c.gate_up.block_n}k{c.gate_up.block_k}-n{c.down.block_n}k{c.down.block_k}-"
                  f"{c.reduce}"))
@pytest.mark.parametrize("name", ["all_tokens_one_expert", "small_fp8_per_tensor", "fp8_block_h_i_not_multiple_of_128",
                                  "small_mxfp4"])
def test_each_launch_config(config: LaunchConfig, name: str) -> None:
    # Tiles smaller and larger than H and I, one row block or many per expert, every grouping, both
    # ways of taking the top-k sum.
    with override_launch_config(config):
        _check(_build(name, 3), f"{name} under {config}")


# The decode GEMVs serve any T (a program per pair): every case of the quantizations they take, under tiles
# narrower and wider than H and I, one warp to several.
GEMV_CASES = [name for name in SERVED if "fp8" not in name]
# Under the interpreter a program costs ~10 ms, so the tiles are as wide as still leaves several programs and K
# steps on the small cases (H 64-96, I 16-64): 4-row and 2-row tiles cost 2 of CI's 20 minutes.
GEMV_TILES = {
    "n8k32-n16k32": LaunchConfig(16, GemmConfig(8, 32, num_warps=1), GemmConfig(16, 32), gemv=True),
    "n32k64-n8k32": LaunchConfig(16, GemmConfig(32, 64), GemmConfig(8, 32, num_warps=2), gemv=True),
}


@pytest.mark.parametrize("tiles", list(GEMV_TILES))
@pytest.mark.parametrize("name", GEMV_CASES)
def test_the_decode_gemvs_match_the_reference(name: str, tiles: str) -> None:
    if not ON_GPU and "model" in SPEC.case(name).tags:
        pytest.skip(f"GPU only: {name}'s experts take about a minute per call under the Triton interpreter")
    if not ON_GPU and tiles != "n8k32-n16k32" and "edge" not in SPEC.case(name).tags:
        pytest.skip("GPU only: the interpreter runs the second tiles on the edge cases (its ~10 ms a program)")
    with override_launch_config(GEMV_TILES[tiles]):
        _check(_build(name, 9), f"{name}, decode GEMVs {tiles}")


@pytest.mark.parametrize("name", ["small_silu", "expert_map_with_holes", "top1_weight_on_input", "small_mxfp4",
                                  "small_nvfp4_gelu_fp16"])
def test_the_decode_gemvs_read_strided_and_sliced_inputs(name: str) -> None:
    kwargs = _strided(_build(name, 10))
    with override_launch_config(GEMV_TILES["n8k32-n16k32"]):
        _check(kwargs, f"{name}, strided, decode GEMVs")


@triton.jit
def _decode_gemv_fp4(packed_ptr, scale_ptr, even_ptr, odd_ptr, QUANT: tl.constexpr, INTERPRETED: tl.constexpr,
                     BLOCKS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    # [256 rows: one per scale code, BLOCKS blocks of BLOCK_BYTES bytes] -> fp32 weights at even and odd k
    row = tl.arange(0, 256)
    col = tl.arange(0, BLOCKS * BLOCK_BYTES)
    packed = tl.load(packed_ptr + row[:, None] * (BLOCKS * BLOCK_BYTES) + col[None, :])
    scale_codes = tl.load(scale_ptr + row[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :])
    even, odd, scale = FP4.gemv_fp4(packed, scale_codes, QUANT, INTERPRETED)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (256, BLOCKS, BLOCK_BYTES)), (256, BLOCKS * BLOCK_BYTES))
    out = row[:, None] * (BLOCKS * BLOCK_BYTES) + col[None, :]
    tl.store(even_ptr + out, even * scale * FP4.FP4_UNBIAS)
    tl.store(odd_ptr + out, odd * scale * FP4.FP4_UNBIAS)


@pytest.mark.parametrize("quantization", ["mxfp4", "nvfp4"])
def test_gemv_fp4_decoding_of_every_byte_under_every_scale(quantization: str) -> None:
    # gemv_fp4 (the GEMVs' decoding: fp16 bit placement on the GPU, e2m1_values in the interpreter) with its scale
    # and 2^14 applied as the GEMVs do, against the fp32 product of the spec's decoders, for every packed byte
    # under every scale byte. e8m0's range leaves fp16 and bf16: here the products are fp32.
    block_bytes = 16 if quantization == "mxfp4" else 8
    blocks = 32 // block_bytes
    packed = (torch.arange(256 * 32) * 37 % 256).to(torch.uint8).view(256, 32)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, blocks).contiguous()
    even, odd = (torch.full((256, 32), 7.0, device=DEVICE) for _ in range(2))
    _decode_gemv_fp4[(1,)](packed.to(DEVICE), scales.to(DEVICE), even, odd,
                           QUANT=getattr(FP4, quantization.upper()), INTERPRETED=host.INTERPRETED, BLOCKS=blocks,
                           BLOCK_BYTES=block_bytes)
    table = torch.tensor(E2M1_TABLE)
    scale = e8m0_to_float(scales) if quantization == "mxfp4" else scales.view(torch.float8_e4m3fn).float()
    scale = scale.repeat_interleave(block_bytes, dim=1)
    for name, got, nibble in (("even", even, packed.long() & 15), ("odd", odd, packed.long() >> 4)):
        want = table[nibble] * scale
        # e8m0 0 (2^-127) times a value under 2 is an fp32 subnormal: the GPU's fp32 multiply may flush it.
        normal = want.isnan() | (want.abs() >= torch.finfo(torch.float32).tiny) | (want == 0)
        torch.testing.assert_close(got.cpu()[normal], want[normal], rtol=0, atol=0, equal_nan=True, msg=name)


def test_the_pair_sum_skips_pairs_routed_off_rank() -> None:
    # The per-pair rows of off-rank pairs are never written: NaN there must not reach the output.
    kernels = host._kernels()
    tokens, topk, hidden_size = 3, 2, 40
    ids = torch.tensor([[0, 3], [2, 1], [3, 2]], dtype=torch.int32, device=DEVICE)
    expert_map = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)  # experts 1 and 3 elsewhere
    rows = torch.randn(tokens * topk, hidden_size, device=DEVICE).to(torch.bfloat16)
    live = (expert_map[ids.long()] >= 0).flatten()
    rows[~live] = float("nan")
    out = torch.full((tokens, hidden_size), 7.0, dtype=torch.bfloat16, device=DEVICE)
    kernels.moe_sum_kernel[(tokens, 2)](rows, ids, expert_map, out, hidden_size, rows.stride(0), *ids.stride(),
                                        expert_map.stride(0), out.stride(0), TOPK=topk, HAS_MAP=True,
                                        INTERPRETED=host.INTERPRETED, BLOCK_N=32)
    expected = (rows.float() * live[:, None]).nan_to_num(0.0).view(tokens, topk, hidden_size).sum(1)
    torch.testing.assert_close(out.float().cpu(), expected.to(torch.bfloat16).float().cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["expert_map_with_holes", "small_fp8_block", "top1_weight_on_input"])
def test_the_routing_in_three_launches(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spec's small cases fit the one-program routing; the multi-program one serves larger calls.
    monkeypatch.setattr(host, "ROUTE_ONE_PROGRAM_MAX_PAIRS", 0)
    _check(_build(name, 6), f"{name}, routing in three launches")


def _strided(kwargs: dict) -> dict:
    """Every tensor a view with non-unit or padded strides holding the same values."""
    def wide(t: torch.Tensor) -> torch.Tensor:  # last dim strided by 2, every other element a NaN-free decoy
        out = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        out[..., ::2] = t
        return out[..., ::2]

    def transposed(t: torch.Tensor) -> torch.Tensor:  # [E, N, K] held as [E, K, N] storage
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    strided = dict(kwargs)
    strided["hidden"] = wide(kwargs["hidden"])
    strided["w1"] = transposed(kwargs["w1"])
    strided["w2"] = wide(kwargs["w2"])
    strided["topk_weights"] = kwargs["topk_weights"].t().contiguous().t()
    strided["topk_ids"] = wide(kwargs["topk_ids"])
    if kwargs["expert_map"] is not None:
        strided["expert_map"] = wide(kwargs["expert_map"])
    for name in ("w1_scale", "w2_scale", "w1_global_scale", "w2_global_scale"):
        if kwargs[name] is not None:
            strided[name] = wide(kwargs[name])
    return strided


@pytest.mark.parametrize("name", ["small_silu", "expert_map_with_holes", "small_fp8_per_tensor", "small_fp8_block",
                                  "top1_weight_on_input", "small_mxfp4", "small_nvfp4_gelu_fp16"])
def test_strided_and_sliced_inputs(name: str) -> None:
    kwargs = _strided(_build(name, 5))
    assert not kwargs["hidden"].is_contiguous() and not kwargs["w1"].is_contiguous()
    _check(kwargs, f"{name}, strided")


@pytest.mark.parametrize("name", ["small_mxfp4", "mxfp4_expert_map_holes"])
def test_mxfp4_with_fp16_activations(name: str) -> None:
    # MXFP4 with fp16 decodes to fp32 first on the GPU too (e8m0 scales leave fp16's range): that route on
    # the MXFP4 cases with their activations in fp16.
    kwargs = _build(name, 8)
    kwargs["hidden"] = kwargs["hidden"].to(torch.float16)
    _check(kwargs, f"{name}, fp16 activations")


def test_hidden_a_slice_of_a_wider_batch() -> None:
    kwargs = _build("small_silu", 2)
    wider = torch.randn(kwargs["hidden"].shape[0] + 3, kwargs["hidden"].shape[1] + 8, device=DEVICE)
    wider = wider.to(kwargs["hidden"].dtype)
    wider[2:-1, 5:-3] = kwargs["hidden"]
    kwargs["hidden"] = wider[2:-1, 5:-3]
    _check(kwargs, "a sliced batch")


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-launches"])
def test_the_routing_layout_places_every_local_pair_once(one_program: bool) -> None:
    # The layout on its own: each expert's run starts at a block boundary, holds exactly its pairs
    # (each once), and every block before the padded total names the expert whose run it is in.
    # The one-program kernel zeroes its own counts and walks the pairs in several chunks here.
    kwargs = _build("expert_map_with_holes", 1)
    ids, expert_map = kwargs["topk_ids"], kwargs["expert_map"]
    experts, block_m = kwargs["w1"].shape[0], 16
    pairs = ids.numel()
    max_rows = -(-(pairs + min(experts, pairs) * (block_m - 1)) // block_m) * block_m
    kernels = host._kernels()
    counts = torch.full((experts,), -5 if one_program else 0, dtype=torch.int32, device=DEVICE)
    starts, cursor = (torch.full((experts,), -5, dtype=torch.int32, device=DEVICE) for _ in range(2))
    total = torch.full((1,), -5, dtype=torch.int32, device=DEVICE)
    block_expert = torch.full((max_rows // block_m,), -5, dtype=torch.int32, device=DEVICE)
    rows = torch.full((max_rows,), -5, dtype=torch.int32, device=DEVICE)
    strides = (*ids.stride(), expert_map.stride(0))
    topk = ids.shape[1]
    if one_program:
        assert pairs > 16
        kernels.moe_route_kernel[(1,)](ids, expert_map, counts, starts, cursor, block_expert, total, rows, pairs,
                                       experts, max_rows // block_m, *strides, TOPK=topk, HAS_MAP=True, BLOCK=16,
                                       BLOCK_M=block_m, E_PAD=16, CHUNK=4)
    else:
        kernels.moe_count_kernel[(1,)](ids, expert_map, counts, pairs, *strides, TOPK=topk, HAS_MAP=True, BLOCK=64)
        kernels.moe_layout_kernel[(1,)](counts, starts, cursor, block_expert, total, experts, max_rows // block_m,
                                        BLOCK_M=block_m, E_PAD=16, CHUNK=4)
        kernels.moe_scatter_kernel[(1,)](ids, expert_map, cursor, rows, pairs, *strides, TOPK=topk, HAS_MAP=True,
                                         BLOCK=64)
    local = expert_map.long()[ids.long()].flatten().cpu()
    counts, starts, rows = counts.cpu(), starts.cpu(), rows.cpu()
    block_expert, total = block_expert.cpu(), int(total.cpu())
    assert counts.tolist() == [int((local == e).sum()) for e in range(experts)]
    padded = (counts + block_m - 1) // block_m * block_m
    assert starts.tolist() == (torch.cumsum(padded, 0) - padded).tolist()
    assert total == int(padded.sum())
    for e in range(experts):
        run = rows[starts[e]:starts[e] + counts[e]]
        assert sorted(run.tolist()) == (local == e).nonzero().flatten().tolist()
        first, last = int(starts[e]) // block_m, (int(starts[e]) + int(padded[e])) // block_m
        assert (block_expert[first:last] == e).all()
    assert (block_expert[total // block_m:] == -1).all()


# ---------------------------------------------------------------------------------------------
# GPU only


@pytest.mark.skipif(not ON_GPU, reason="GPU only: the native fp8 route is the hardware cast (sm_89+)")
@pytest.mark.parametrize("name", ["small_fp8_block", "small_fp8_per_tensor", "deepseek_v3_t16_fp8_block_ep256"])
def test_both_fp8_routes_on_the_gpu(name: str) -> None:
    if not native_fp8_cast(torch.device(DEVICE)):
        pytest.skip("GPU only: this GPU has no hardware e4m3 cast (sm_89+)")
    kwargs = _build(name, 4)
    with force_software_fp8():
        software = _check(kwargs, f"{name}, integer route")
    native = _check(kwargs, f"{name}, hardware cast")
    # Same codes either way (both round to nearest even), so only accumulation order may differ.
    torch.testing.assert_close(native.float(), software.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="GPU only: CUDA-graph capture")
@pytest.mark.parametrize("name", ["qwen3_30b_a3b_t16_ep16", "small_fp8_block", "expert_map_with_holes"])
def test_a_captured_call_replays_on_new_routing(name: str) -> None:
    # No launch reads a device value on the host: a graph captured once serves new routing.
    kwargs = _build(name, 0)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fused_moe(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(**static)
    fresh = _build(name, 11)
    for k in ("hidden", "topk_weights", "topk_ids"):
        static[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    SPEC.check_close(out, SPEC.reference(**{**kwargs, **{k: static[k] for k in ("hidden", "topk_weights",
                                                                                   "topk_ids")}}), static)

