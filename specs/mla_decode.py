"""mla_decode: DeepSeek multi-head latent attention in the absorbed form, over a paged latent cache
(decode and MTP/speculative queries, bf16 or fp8 e4m3 cache); the spec, its reference and its cases."""

import itertools
from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.errors import InvalidArgumentError
from kernelmux.specs._check_data import enforce, paged_batch_rules
from kernelmux.specs._compare import assert_close
from kernelmux.specs._key import Layout, layout, size_class
from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance, drawn, shapes_strategy
from kernelmux.specs._tolerance import ATTENTION_OUTPUT
from kernelmux.specs._validate import check_int, check_paged_batch, check_tensor
from kernelmux.specs.kv_cache_write import FP8, check_scale, random_cache

# No `from __future__ import annotations` here: torch.library reads these annotations as types.

__all__ = ["SPEC", "Key", "mla_decode"]

NAME = "mla_decode"
QUERY_DTYPES = (torch.bfloat16, torch.float16)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int = 512,
    kv_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form MLA: every head attends over one shared latent sequence; keys are the full
    latent rows (``c_kv`` then ``k_pe``), values their first ``kv_lora_rank`` dims (``c_kv``).

    Args:
        q: ``[T, H, D]`` bf16/fp16, ``D = kv_lora_rank + rope dim`` (DeepSeek-V3: 512 + 64 = 576):
            the query already multiplied by ``W_UK`` (absorbed nope part, ``kv_lora_rank`` dims)
            followed by its RoPE'd part. Sequence ``b``'s ``q_len_b`` queries are rows
            ``cu_seqlens_q[b] : cu_seqlens_q[b+1]``.
        kv_cache: ``[num_blocks, block_size, D]``, q's dtype or float8_e4m3fn: per position the
            latent ``c_kv`` (``kv_lora_rank`` dims) then ``k_pe``. One "head", shared by all H.
        cu_seqlens_q: ``[B+1]`` int32, ``0 = cu[0] <= ... <= cu[B] = T``; ``1 <= q_len_b <= L_b``
            (1 = decode; 2-4 = MTP / speculative verification).
        block_table: ``[B, max_blocks]`` int32; position ``j`` of sequence ``b`` lives in block
            ``block_table[b, j // block_size]`` at offset ``j % block_size``. Only the first
            ``ceil(L_b / block_size)`` entries of a row are read; the rest may hold anything. Ids
            need not be ordered or distinct across rows. Unread cache slots may hold anything,
            NaN included.
        seq_lens: ``[B]`` int32, ``L_b``: the KV length including this step's tokens.
        max_query_len: host int, at least every ``q_len_b``.
        max_seq_len: host int, at least every ``L_b``.
        scale: multiplies ``q . k`` over all ``D`` dims (DeepSeek-V3: ``192 ** -0.5 * mscale**2``).
        kv_lora_rank: ``r``, the value width, ``1 <= r <= D`` (DeepSeek-V2/V3: 512).
        kv_scale: fp32 tensor of one element, or None (= 1.0); fp8 caches only: row = code * scale
            (one scale for c_kv and k_pe alike).
        return_lse: also return the log-sum-exp of the scaled scores.

    Causal as paged_attention: query ``i`` of sequence ``b`` sits at position
    ``p = L_b - q_len_b + i`` and sees positions ``0 .. p``.

    Returns:
        ``(out, lse)``: ``out [T, H, r]`` in q's dtype, ``softmax(s) @ c_kv`` with
        ``s = scale * q . kv^T`` (computed in fp32); ``lse [T, H]`` fp32, natural log,
        ``log(sum_j exp(s_j))`` over the visible positions, when ``return_lse``; otherwise an
        empty fp32 tensor of shape ``[0]`` (a torch custom op cannot return None inside a tuple,
        and a fixed tuple arity keeps one schema for both modes).
    """
    num_tokens, num_heads = q.shape[0], q.shape[1]
    block_size = kv_cache.shape[1]
    device = q.device
    out = torch.zeros((num_tokens, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.zeros((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    starts = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        # [blocks, block_size, D] -> [kv_len, D]: positions in order; unread tails dropped before
        # any arithmetic (they may be NaN).
        kv = kv_cache[blocks].flatten(0, 1)[:kv_len].float()
        if kv_scale is not None:
            kv = kv * kv_scale.float().reshape(())
        scores = torch.einsum("qhd,kd->hqk", q[start:end].float(), kv) * scale  # [H, q_len, L]
        position = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        visible = torch.arange(kv_len, device=device)[None, :] <= position  # [q_len, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,kr->qhr", probs, kv[:, :kv_lora_rank]).to(q.dtype)
        if return_lse:
            lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    return out, lse


class Key(NamedTuple):
    """mla_decode's dispatch key: what an implementation may decide on (OpSpec.key). Sizes that
    change per batch are classes (``size_class``); ``max_query_len`` is small in decode and MTP
    batches (1-4) and is kept exactly, with ``uniform_queries`` (T == B * max_query_len, host
    ints), which proves every sequence has max_query_len queries, since none has more: decode
    kernels such as FlashMLA's take a fixed count per sequence."""

    device: torch.device
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    num_heads: int
    width: int  # q.shape[2]: kv_lora_rank latent dims then the rope dims
    kv_lora_rank: int
    block_size: int
    num_tokens_class: int
    num_seqs_class: int
    max_query_len: int
    max_seq_len_class: int  # the longest context (host int): not read by kernels, it buckets tuning tables
    uniform_queries: bool
    scale: float
    return_lse: bool
    q_layout: Layout
    kv_cache_layout: Layout
    cu_seqlens_q_layout: Layout
    block_table_layout: Layout
    seq_lens_layout: Layout
    kv_scale_layout: Optional[Layout]  # None: no scale (1.0)


def validate(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int = 512,
    kv_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Key:
    """Check a call against the spec; return the dispatch key. Reads metadata only: the contents
    of cu_seqlens_q, block_table and seq_lens are device data and stay unchecked."""
    check_tensor(NAME, "q", q, dtypes=QUERY_DTYPES, rank=3)
    device = q.device  # read once: building a torch.device costs ~0.3 us
    num_tokens, num_heads, head_dim = q.shape
    check_tensor(NAME, "kv_cache", kv_cache, dtypes=(q.dtype, FP8), rank=3, device=device)
    if kv_cache.shape[2] != head_dim:
        raise InvalidArgumentError(
            NAME, "kv_cache", f"row width D = {head_dim} (q.shape[2]) in kv_cache.shape[2]",
            tuple(kv_cache.shape),
        )
    batch = check_paged_batch(
        NAME, cu_seqlens_q, block_table, seq_lens, max_query_len, max_seq_len, scale, device
    )
    check_int(NAME, "kv_lora_rank", kv_lora_rank, low=1, high=head_dim)
    check_scale(NAME, "kv_scale", kv_scale, kv_cache.dtype, device)
    if type(return_lse) is not bool:
        raise InvalidArgumentError(NAME, "return_lse", "a bool", type(return_lse).__name__)
    return Key(
        device=device, q_dtype=q.dtype, cache_dtype=kv_cache.dtype, num_heads=num_heads, width=head_dim,
        kv_lora_rank=kv_lora_rank, block_size=kv_cache.shape[1], num_tokens_class=size_class(num_tokens),
        num_seqs_class=size_class(batch), max_query_len=max_query_len, max_seq_len_class=size_class(max_seq_len),
        uniform_queries=num_tokens == batch * max_query_len, scale=scale, return_lse=return_lse,
        q_layout=layout(q), kv_cache_layout=layout(kv_cache), cu_seqlens_q_layout=layout(cu_seqlens_q),
        block_table_layout=layout(block_table), seq_lens_layout=layout(seq_lens), kv_scale_layout=layout(kv_scale),
    )


def check_data(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int = 512,
    kv_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> None:
    """Checked mode: the batch description's contents against the queries and the cache (causal:
    a sequence's queries are its last positions)."""
    enforce(NAME, paged_batch_rules(cu_seqlens_q, block_table, seq_lens, q.shape[0], max_query_len,
                                    max_seq_len, kv_cache.shape[1], kv_cache.shape[0], causal=True))


def fake(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int = 512,
    kv_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads = q.shape[0], q.shape[1]
    return (
        q.new_empty((num_tokens, num_heads, kv_lora_rank)),
        q.new_empty((num_tokens, num_heads) if return_lse else (0,), dtype=torch.float32),
    )


# The attention output table, justified in specs/_tolerance.py.
TOLERANCE = ATTENTION_OUTPUT
# lse is fp32 from scores whose inputs are exact in fp32 (bf16/fp16/fp8 products), so kernels and
# the reference differ only by fp32 summation order over 576 terms (~sqrt(576) * 2^-24 * sum|q_d
# k_d| * scale, ~1e-5 for the cases' |s| <= ~15), exp2/log2 with approx instructions (rel. ~2^-22)
# and the base-2 rescaling FlashMLA does (lse = (m + log2 l) * ln 2). 1e-4 absolute + 1e-5
# relative leaves a 10x margin and still catches a wrong base (x ln 2 = 0.69) or a missing scale.
LSE_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-5)


def check_close(actual: Any, expected: Any, kwargs: Mapping[str, Any]) -> None:
    for got, want, what in zip(actual, expected, ("out [T, H, r]", "lse [T, H]")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
            raise AssertionError(
                f"{NAME} {what}: got {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                f"{tuple(want.shape)} {want.dtype} on {want.device}"
            )
    assert_close(actual[0], expected[0], TOLERANCE[kwargs["q"].dtype], f"{NAME} out [T, H, r]")
    if kwargs["return_lse"]:
        assert_close(actual[1], expected[1], LSE_TOLERANCE, f"{NAME} lse [T, H]")


def cost(kwargs: Mapping[str, Any]) -> Cost:
    q, kv_cache = kwargs["q"], kwargs["kv_cache"]
    num_heads, head_dim = q.shape[1], q.shape[2]
    rank, block_size = kwargs["kv_lora_rank"], kv_cache.shape[1]
    starts = kwargs["cu_seqlens_q"].tolist()
    pairs = positions = table = 0
    for b, kv_len in enumerate(kwargs["seq_lens"].tolist()):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0 or kv_len == 0:
            continue
        # Causal: query i sees L - q_len + i + 1 positions; the last one sees all L.
        pairs += q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
        positions += kv_len
        table += -(-kv_len // block_size)
    # QK^T over D dims and PV over r dims, 2 flops per multiply-add, per visible pair and head.
    flops = 2 * (head_dim + rank) * num_heads * pairs
    metadata = sum(kwargs[n].numel() * kwargs[n].element_size() for n in ("cu_seqlens_q", "seq_lens"))
    scale_bytes = 4 if kwargs["kv_scale"] is not None else 0
    out_bytes = q.shape[0] * num_heads * (rank * q.element_size() + (4 if kwargs["return_lse"] else 0))
    bytes_moved = (
        q.numel() * q.element_size()
        + out_bytes
        + positions * head_dim * kv_cache.element_size()  # each latent row once, shared by all heads
        + metadata + table * 4 + scale_bytes
    )
    return Cost(flops=flops, bytes=bytes_moved)


# ---------------------------------------------------------------------------------------------
# Cases. Caches are random everywhere (unused blocks, the tail of each sequence's last block),
# block ids are a random permutation (non-monotonic) and block-table rows carry unused trailing
# entries pointing at other random blocks, so reading a wrong slot changes the output.

DEEPSEEK_V3_SCALE = 192**-0.5 * (0.1 * 1.0 * 3.6888794541139363 + 1.0) ** 2  # yarn factor 40


def _maker(
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    num_heads: int,
    head_dim: int = 576,
    kv_lora_rank: int = 512,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: Optional[torch.dtype] = None,
    kv_scale: Optional[float] = None,
    scale: Optional[float] = None,
    return_lse: bool = True,
    table_slack: int = 2,
    spare_blocks: int = 3,
    nan_in_unused: bool = False,
):
    """Sequences ``b`` with ``q_lens[b]`` queries over ``kv_lens[b]`` cached positions. ``scale``
    defaults to ``head_dim ** -0.5``; ``nan_in_unused`` fills every unread cache slot with NaN."""
    if len(q_lens) != len(kv_lens) or any(q > kv for q, kv in zip(q_lens, kv_lens)):
        raise ValueError(f"{NAME}: need one q_len per kv_len and q_len <= kv_len")
    cache_dtype = cache_dtype or dtype
    softmax_scale = head_dim**-0.5 if scale is None else scale

    def make(device: torch.device, generator: torch.Generator) -> dict[str, Any]:
        needed = [-(-kv // block_size) for kv in kv_lens]
        num_blocks = sum(needed) + spare_blocks
        ids = torch.randperm(num_blocks, generator=generator)
        table = torch.randint(0, num_blocks, (len(kv_lens), max(needed, default=0) + table_slack),
                              generator=generator)
        taken = 0
        for b, n in enumerate(needed):
            table[b, :n] = ids[taken : taken + n]
            taken += n
        cache = random_cache((num_blocks, block_size, head_dim), cache_dtype, generator)
        if nan_in_unused:
            read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
            for b, kv_len in enumerate(kv_lens):
                positions = torch.arange(kv_len)
                read[table[b, positions // block_size], positions % block_size] = True
            if cache.dtype == FP8:
                cache.view(torch.uint8)[~read] = 0x7F  # e4m3fn's NaN code (masked_fill has no fp8 kernel)
            else:
                cache[~read] = float("nan")
        kwargs = {
            "q": torch.randn(sum(q_lens), num_heads, head_dim, generator=generator, dtype=dtype),
            "kv_cache": cache,
            "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
            "block_table": table.to(torch.int32),
            "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
            "max_query_len": max(q_lens, default=0),
            "max_seq_len": max(kv_lens, default=0),
            "scale": softmax_scale,
            "kv_lora_rank": kv_lora_rank,
            "kv_scale": torch.tensor(kv_scale, dtype=torch.float32) if kv_scale is not None else None,
            "return_lse": return_lse,
        }
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    return make


def _deepseek(batch: int, context: int, heads: int, q_len: int = 1, **options: Any):
    return _maker((q_len,) * batch, (context,) * batch, heads, 576, 512, 64,
                  scale=DEEPSEEK_V3_SCALE, **options)


def _cases() -> tuple[Case, ...]:
    model, quick = frozenset({"model"}), frozenset({"model", "quick"})
    rand, edge = frozenset({"random", "quick"}), frozenset({"edge", "quick"})
    gpu = frozenset({"model", "gpu"})
    scaled = "; the gpu-tagged cases scale the grid up"
    cases = []
    for heads, who in ((128, "DeepSeek-V3 (128 heads, TP1)"), (16, "DeepSeek-V3 at TP8 (16 heads)")):
        for batch, context in ((1, 512), (1, 4096), (8, 512), (8, 4096), (64, 512), (64, 4096)):
            # B 64 x 4096 (a 300 MB cache) takes ~1-1.5 s to build and run on a 2-core CPU: model only.
            tags = model if (batch, context) == (64, 4096) else quick
            cases.append(Case(f"deepseek_v3_h{heads}_decode_b{batch}_ctx{context}",
                              _deepseek(batch, context, heads), tags,
                              f"{who} decode, B {batch} x context {context}, 512+64, block 64" + scaled))
    cases += [
        # The perf goals' shapes beyond B 64 x 4096 bf16 (accelerators only).
        Case("deepseek_v3_h128_decode_b128_ctx4096", _deepseek(128, 4096, 128), gpu,
             "DeepSeek-V3 (128 heads) decode, B 128 x 4096 (perf goal)"),
        Case("deepseek_v3_h128_fp8_decode_b64_ctx4096",
             _deepseek(64, 4096, 128, cache_dtype=FP8, kv_scale=0.23), gpu,
             "DeepSeek-V3 (128 heads) decode with an fp8 latent cache, B 64 x 4096 (perf goal)"),
        Case("deepseek_v3_h128_fp8_decode_b128_ctx4096",
             _deepseek(128, 4096, 128, cache_dtype=FP8, kv_scale=0.23), gpu,
             "DeepSeek-V3 (128 heads) decode with an fp8 latent cache, B 128 x 4096 (perf goal)"),
        Case("deepseek_v3_h16_mtp2_b8_ctx4096", _deepseek(8, 4096, 16, q_len=2), quick,
             "MTP: DeepSeek-V3's one-token multi-token prediction verifies 2 queries per sequence"),
        Case("deepseek_v3_h128_mtp4_b8_ctx512", _deepseek(8, 512, 128, q_len=4), quick,
             "speculative decoding with 3 draft tokens: 4 causal queries per sequence"),
        Case("deepseek_v3_h16_mtp_mixed", _maker((1, 3, 2, 4), (700, 64, 130, 4), 16,
                                                 scale=DEEPSEEK_V3_SCALE), quick,
             "varlen MTP batch: q_len 1-4 per sequence (not uniform), one sequence with q_len = L"),
        Case("deepseek_v3_h16_fp8_decode_b8_ctx4096",
             _deepseek(8, 4096, 16, cache_dtype=FP8, kv_scale=0.23), quick,
             "fp8 e4m3 latent cache with a per-tensor scale (not a power of two)"),
        Case("deepseek_v3_h128_fp8_mtp2_b8_ctx512",
             _deepseek(8, 512, 128, q_len=2, cache_dtype=FP8, kv_scale=0.25), quick,
             "fp8 latent cache with MTP queries, 128 heads"),
        Case("deepseek_v3_h16_decode_no_lse", _deepseek(8, 512, 16, return_lse=False), quick,
             "return_lse=False: lse is the empty [0] tensor"),
        Case("small_decode", _maker((1, 1, 1), (1, 17, 40), 4, 40, 32, block_size=8), rand,
             "small D 40 = 32 + 8; lengths 1, one past two blocks, a partial block"),
        Case("small_mtp_fp16", _maker((3, 2, 1), (9, 2, 20), 3, 24, 16, block_size=4,
                                      dtype=torch.float16), rand,
             "fp16 queries and cache, MTP lengths, q_len = L for one sequence"),
        Case("small_fp8", _maker((1, 2), (19, 6), 4, 40, 32, block_size=8, cache_dtype=FP8,
                                 kv_scale=0.3), rand, "fp8 cache, scale 0.3"),
        Case("small_fp8_no_scale", _maker((1, 1), (5, 9), 2, 24, 16, block_size=4, cache_dtype=FP8,
                                          scale=0.05), rand,
             "fp8 cache without a scale (1.0); scale 0.05 keeps codes of ~N(0, 16) tame"),
        Case("small_no_rope", _maker((2, 1), (7, 3), 2, 16, 16, block_size=4), rand,
             "kv_lora_rank = D (no rope dims): plain MQA with V = K"),
        Case("empty_batch", _deepseek(0, 0, 16), edge, "B = 0, T = 0: returns [0, H, 512] and [0, H]"),
        Case("seq_len_1", _deepseek(2, 1, 16), edge,
             "L = 1: each query attends only to its own position; out = that latent row"),
        Case("partial_blocks", _maker((1, 2, 1), (65, 127, 63), 16, scale=DEEPSEEK_V3_SCALE), edge,
             "lengths 65, 127, 63 with block size 64: stale random data in the last blocks' tails"),
        Case("table_slack_permuted", _maker((1, 1), (300, 100), 16, table_slack=9, spare_blocks=20,
                                            scale=DEEPSEEK_V3_SCALE), edge,
             "block-table rows with 9+ unused trailing entries pointing at random blocks; "
             "non-monotonic block ids"),
        Case("nan_in_unused_slots", _maker((1, 2, 1), (70, 33, 5), 16, table_slack=3,
                                           scale=DEEPSEEK_V3_SCALE, nan_in_unused=True), edge,
             "NaN in every slot no sequence reads (spare blocks, block tails): a kernel that "
             "multiplies masked slots by 0 instead of skipping them returns NaN"),
        Case("block_size_1", _maker((2, 1), (5, 3), 2, 24, 16, block_size=1), edge,
             "block size 1: one position per block"),
    ]
    return tuple(cases)



@shapes_strategy
def _shapes(draw: Any, st: Any) -> Case:
    """Drawn batches: up to 4 sequences of 1-4 queries (decode, MTP, mixed) over contexts of up to
    80, DeepSeek's 576/512 latent or a small 80/64 one, 1-16 heads, fp8 caches, with and without lse."""
    lengths = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 80)), max_size=4))
    kv_lens = tuple(max(kv, q) for q, kv in lengths)
    q_lens = tuple(q for q, _ in lengths)
    num_heads = draw(st.sampled_from([1, 4, 16]))
    head_dim, rank = draw(st.sampled_from([(576, 512), (80, 64)]))
    block_size = draw(st.sampled_from([16, 64]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    fp8 = draw(st.booleans())
    lse = draw(st.booleans())
    return drawn(f"q {q_lens} over kv {kv_lens}, {num_heads} heads, width {head_dim} (rank {rank}), block "
                 f"{block_size}, {str(dtype)[6:]}{', fp8 cache' if fp8 else ''}, lse {lse}",
                 _maker(q_lens, kv_lens, num_heads, head_dim, rank, block_size, dtype, FP8 if fp8 else None,
                        0.23 if fp8 else None, return_lse=lse))


SPEC = OpSpec(
    name=NAME,
    version=1,
    reference=mla_decode,
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
