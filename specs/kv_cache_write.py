"""kv_cache_write: scatter this step's keys and values into vLLM's paged NHD KV cache (in place,
quantizing for fp8 caches); the spec, its reference and its cases. Companion of paged_attention."""

from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import enforce, index_rule
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._validate import check_tensor

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["FP8_MAX", "SPEC", "Key", "check_scale", "kv_cache_write", "quantize_to_cache_fp8"]

NAME = "kv_cache_write"
KV_DTYPES = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_to_cache_fp8(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``x / scale`` in fp32 (a true division, as vLLM's ``scaled_fp8_conversion``), saturated to
    +-448, rounded to nearest-even e4m3fn. NaN stays NaN. Shared with paged_attention's cases."""
    x = x.float()
    if scale is not None:
        x = x / scale.float().reshape(())
    # torch's own cast does not promise saturation (out-of-range values may become NaN), so clamp.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write token ``t``'s key and value to cache slot ``slot_mapping[t]``, in place.

    Args:
        key: ``[T, Hkv, D]`` bf16/fp16, this step's keys (after RoPE), any strides.
        value: ``[T, Hkv, D]``, same dtype and shape as ``key``.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` (vLLM's NHD layout), the dtype of ``key`` or
            float8_e4m3fn; any strides (e.g. a view of a joint ``[2, num_blocks, ...]`` cache).
            Written in place.
        v_cache: like ``k_cache`` (same shape and dtype). Written in place.
        slot_mapping: ``[T]`` int64. ``slot = block * block_size + offset``; a negative slot marks
            a padding token, which is skipped (its cache contents are left untouched). Non-negative
            slots must be distinct and ``< num_blocks * block_size`` (unchecked: device data).
        k_scale: fp32 tensor with one element (shape ``()`` or ``(1,)``), or None (= 1.0). Only
            for fp8 caches, where the cache holds ``saturate(key / k_scale)`` rounded to
            nearest-even e4m3fn (a true fp32 division, bit-exact, saturating at +-448). A tensor,
            not a float: a scale computed on the device (vLLM's ``calculate_kv_scales``) is then
            read by the kernel with no host sync, CUDA-graph replays see its current value, and
            torch.compile does not bake one layer's value into the graph.
        v_scale: the same for ``value``.

    Returns:
        None; ``k_cache`` and ``v_cache`` are mutated.
    """
    valid = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    index = (slots // block_size, slots % block_size)
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = new[valid]
        rows = quantize_to_cache_fp8(rows, scale) if cache.dtype == FP8 else rows.to(cache.dtype)
        # index_put_ on the cache itself writes through any strides (flattening could copy).
        cache.index_put_(index, rows)


def check_scale(op: str, name: str, scale: Any, cache_dtype: torch.dtype, device: torch.device) -> None:
    """A per-tensor KV scale: None, or an fp32 tensor with one element on ``device``, and only
    when the cache is fp8 (shared with paged_attention)."""
    if scale is None:
        return
    if cache_dtype != FP8:
        raise InvalidArgumentError(
            op, name, f"None for a {cache_dtype} cache (scales apply to float8_e4m3fn caches only)",
            "a tensor", hint=f"pass {name}=None unless the cache is fp8",
        )
    if not isinstance(scale, torch.Tensor):
        raise InvalidArgumentError(op, name, "an fp32 torch.Tensor with one element, or None",
                                   type(scale).__name__)
    if scale.dtype != torch.float32 or scale.shape not in ((), (1,)):
        raise InvalidArgumentError(op, name, "an fp32 tensor of shape () or (1,)",
                                   f"{scale.dtype} tensor of shape {tuple(scale.shape)}")
    if scale.device != device:
        raise InvalidArgumentError(op, name, f"a tensor on {device} (the device of the first input)",
                                   scale.device)


class Key(NamedTuple):
    """kv_cache_write's dispatch key: what an implementation may decide on (OpSpec.key)."""

    device: torch.device
    kv_dtype: torch.dtype
    cache_dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens_class: int
    key_layout: Layout
    value_layout: Layout
    k_cache_layout: Layout
    v_cache_layout: Layout
    slot_mapping_layout: Layout
    k_scale_layout: Optional[Layout]  # None: no scale (1.0)
    v_scale_layout: Optional[Layout]


def validate(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Key:
    """Check a call against the spec; return the dispatch key."""
    check_tensor(NAME, "key", key, dtypes=KV_DTYPES, rank=3)
    device = key.device
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor(NAME, "value", value, dtypes=(key.dtype,), rank=3, device=device)
    if value.shape != key.shape:
        raise InvalidArgumentError(NAME, "value", f"shape {tuple(key.shape)} (key's)", tuple(value.shape))
    cache_dtypes = (key.dtype, FP8)
    check_tensor(NAME, "k_cache", k_cache, dtypes=cache_dtypes, rank=4, device=device)
    if k_cache.shape[2:] != key.shape[1:]:
        raise InvalidArgumentError(
            NAME, "k_cache", f"shape (num_blocks, block_size, {num_kv_heads}, {head_dim}) to match "
            "key's (Hkv, D)", tuple(k_cache.shape),
        )
    check_tensor(NAME, "v_cache", v_cache, dtypes=(k_cache.dtype,), rank=4, device=device)
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(NAME, "v_cache", f"shape {tuple(k_cache.shape)} (k_cache's)",
                                   tuple(v_cache.shape))
    check_tensor(NAME, "slot_mapping", slot_mapping, dtypes=(torch.int64,), rank=1, device=device)
    if slot_mapping.shape[0] != num_tokens:
        raise InvalidArgumentError(NAME, "slot_mapping", f"shape ({num_tokens},) (one slot per key row)",
                                   tuple(slot_mapping.shape))
    check_scale(NAME, "k_scale", k_scale, k_cache.dtype, device)
    check_scale(NAME, "v_scale", v_scale, k_cache.dtype, device)
    return Key(
        device=device, kv_dtype=key.dtype, cache_dtype=k_cache.dtype, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=k_cache.shape[1], num_tokens_class=size_class(num_tokens),
        key_layout=layout(key), value_layout=layout(value), k_cache_layout=layout(k_cache),
        v_cache_layout=layout(v_cache), slot_mapping_layout=layout(slot_mapping), k_scale_layout=layout(k_scale),
        v_scale_layout=layout(v_scale),
    )


def check_data(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Checked mode: every slot inside the cache (negative slots are padding)."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    enforce(NAME, [index_rule("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"the cache's {num_blocks} blocks x {block_size} slots", negative_skips=True)])


def fake(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    return None


# The op is a copy (bf16/fp16 caches) or a correctly rounded fp32 division and cast (fp8 caches):
# there is nothing to be approximately right about, so conformance is bit-exact (check_close
# compares bytes) and no tolerance applies. The table is kept for the framework's uniformity.
TOLERANCE = {dtype: Tolerance(atol=0.0, rtol=0.0) for dtype in KV_DTYPES}


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    """Both whole caches, byte for byte: written slots and untouched ones (padding, other blocks)."""
    for got, want, what in zip(actual, expected, ("k_cache", "v_cache")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
        got_bytes = got.detach().cpu().contiguous().view(torch.uint8)
        want_bytes = want.detach().cpu().contiguous().view(torch.uint8)
        if torch.equal(got_bytes, want_bytes):
            continue
        element = got.element_size()
        differ = (got_bytes != want_bytes).view(*got.shape, element).any(-1)
        where = differ.nonzero()[:5].tolist()
        rows = ", ".join(
            f"{tuple(c)} (slot {c[0] * got.shape[1] + c[1]}): got {got[tuple(c)].float().item():.7g}, "
            f"expected {want[tuple(c)].float().item():.7g}"
            for c in where
        )
        raise AssertionError(
            f"{NAME} {what}: {int(differ.sum())} of {got.numel()} elements differ in their bytes "
            f"({got.dtype}, compared exactly); first {rows}"
        )


def cost(kwargs: Mapping[str, Any]) -> Cost:
    key, k_cache, slots = kwargs["key"], kwargs["k_cache"], kwargs["slot_mapping"]
    # Padding tokens need neither be read nor written; counting them is a sync, fine off the hot path.
    written = int((slots >= 0).sum()) if slots.numel() else 0
    row = key.shape[1] * key.shape[2]
    # One division per element for fp8 caches; a copy otherwise.
    flops = 2 * written * row if k_cache.dtype == FP8 else 0
    bytes_moved = (
        2 * written * row * key.element_size()
        + slots.numel() * slots.element_size()
        + 2 * written * row * k_cache.element_size()
        + sum(4 for s in (kwargs["k_scale"], kwargs["v_scale"]) if s is not None)
    )
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases. Caches start full of random data (not zeros), so a write to a wrong slot, or one that
# clobbers a neighbour or a padding token's slot, changes bytes that check_close compares.


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random cache contents; for fp8, codes of N(0, 4^2) values (dequantize to ~N(0, 1) at scale
    0.25-ish). Shared with paged_attention's cases."""
    if dtype == FP8:
        return quantize_to_cache_fp8(torch.randn(shape, generator=generator) * 4, None)
    return torch.randn(shape, generator=generator, dtype=dtype)


def _maker(
    tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: Optional[torch.dtype] = None,
    padding: float = 0.0,
    scales: Optional[tuple[float, float]] = None,
    magnitude: float = 1.0,
):
    """``tokens`` rows to distinct random slots of a ``num_blocks``-block cache; a ``padding``
    fraction of them get negative slots (-1 and other negatives: any negative means padding)."""
    cache_dtype = cache_dtype or dtype
    if tokens > num_blocks * block_size:
        raise ValueError(f"{NAME}: {tokens} tokens do not fit {num_blocks} blocks of {block_size}")

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key = torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * magnitude
        value = torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * magnitude
        slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
        pad = torch.rand(tokens, generator=generator) < padding
        negatives = -torch.randint(1, 3, (tokens,), generator=generator) ** 3  # -1 or -8
        slots = torch.where(pad, negatives, slots)
        kwargs = {
            "key": key.to(dtype),
            "value": value.to(dtype),
            "k_cache": random_cache(shape, cache_dtype, generator),
            "v_cache": random_cache(shape, cache_dtype, generator),
            "slot_mapping": slots.to(torch.int64),
            "k_scale": None,
            "v_scale": None,
        }
        if scales is not None:
            kwargs["k_scale"] = torch.tensor(scales[0], dtype=torch.float32)
            kwargs["v_scale"] = torch.tensor([scales[1]], dtype=torch.float32)  # (1,) is allowed too
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    rand, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    # Llama-3-8B: 8 kv heads of 128; Llama-3-70B at TP8: 1 kv head of 128. Block size 16 (vLLM's
    # default). Caches hold a few more blocks than the tokens need.
    return (
        Case("llama3_8b_decode_b256", _maker(256, 8, 128, 16, 1024), quick,
             "Llama-3-8B decode step of 256 sequences: one token each, scattered slots"),
        Case("llama3_8b_prefill_t1024", _maker(1024, 8, 128, 16, 80), quick,
             "Llama-3-8B prefill of 1024 tokens"),
        Case("llama3_8b_prefill_t8192", _maker(8192, 8, 128, 16, 520), model,
             "Llama-3-8B prefill of 8192 tokens (the largest prefill of the grid)"),
        Case("llama3_70b_tp8_prefill_t1024", _maker(1024, 1, 128, 16, 80), quick,
             "Llama-3-70B at TP8: a single kv head per rank"),
        Case("llama3_8b_fp8_prefill_t1024",
             _maker(1024, 8, 128, 16, 80, cache_dtype=FP8, scales=(0.0173, 0.0291), magnitude=3.0),
             quick, "Llama-3-8B with an fp8 cache and calibrated per-tensor scales; values large "
             "enough that some saturate at +-448"),
        Case("small_fp16_padding", _maker(37, 3, 40, 4, 16, torch.float16, padding=0.3), rand,
             "fp16, odd heads and head dim, 30% padding tokens (negative slots of different values)"),
        Case("small_fp8_scales", _maker(23, 2, 16, 8, 5, cache_dtype=FP8, padding=0.2, scales=(0.3, 0.07),
                                        magnitude=8.0), rand,
             "fp8 cache with scales that are not powers of two (the division must round exactly), "
             "saturation, padding"),
        Case("small_fp8_no_scale", _maker(9, 2, 8, 4, 4, torch.float16, FP8), rand,
             "fp8 cache with no scales (1.0), fp16 input"),
        Case("empty", _maker(0, 8, 128, 16, 4), edge, "T = 0: nothing to write; caches unchanged"),
        Case("all_padding", _maker(12, 2, 16, 4, 4, padding=1.0), edge,
             "every token is padding (a CUDA-graph-padded batch): caches unchanged"),
        Case("block_size_1", _maker(10, 2, 8, 1, 13), edge, "block_size 1: slot = block"),
        Case("fill_every_slot", _maker(32, 1, 8, 8, 4, torch.float16), edge,
             "T = num_blocks * block_size: every slot of the cache is written, the last included"),
    )



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn writes: 0-40 tokens into caches of blocks of 1-16 with spare blocks, 1-8 kv heads,
    head dims 16-128, padding slots, fp8 caches with scales."""
    tokens = draw(st.integers(0, 40))
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = -(-tokens // block_size) + draw(st.integers(1, 3))
    num_kv_heads = draw(st.sampled_from([1, 2, 8]))
    head_dim = draw(st.sampled_from([16, 64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    fp8 = draw(st.booleans())
    padding = draw(st.sampled_from([0.0, 0.3]))
    return drawn(f"T {tokens}, {num_blocks} blocks of {block_size}, {num_kv_heads} kv heads, D {head_dim}, "
                 f"{str(dtype)[6:]}{', fp8 cache' if fp8 else ''}, padding {padding}",
                 _maker(tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, FP8 if fp8 else None,
                        padding, (0.5, 0.25) if fp8 else None))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=kv_cache_write,
    validate=validate,
    fake=fake,
    check_close=check_close,
    cost=cost,
    cases=_cases(),
    tolerance=TOLERANCE,
    key=Key,
    check_data=check_data,
    mutates_args=("k_cache", "v_cache"),
    shapes=_shapes,
)
