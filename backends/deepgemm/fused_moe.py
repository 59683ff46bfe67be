"""The deepgemm backend's fused_moe: DeepSeek-V3 fp8_block experts on DeepGEMM's grouped GEMM
``m_grouped_fp8_gemm_nt_contiguous`` (sm_90), routing, quantization and activation in torch on the
device with no host sync (CUDA-graph capturable). Serves the variants a GPU run confirmed (``CONFIRMED``)."""

from __future__ import annotations

# What it takes, read from sgl-deep-gemm 0.1.4.post1 (deep_gemm/__init__.py, utils/layout.py, the
# headers it ships under include/deep_gemm) and sgl-project/DeepGEMM's csrc (apis/gemm.hpp,
# apis/layout.hpp, utils/layout.hpp, jit_kernels/impls/sm90_fp8_gemm_1d2d.hpp, tests/generators.py):
# - ``m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe, ..., compiled_dims='nk',
#   ...)``: ``a = (codes [M, K] e4m3fn, sfa)``, ``b = (codes [G, N, K] e4m3fn, sfb)``, ``d [M, N]``
#   bf16 (``DG_HOST_ASSERT(d.scalar_type() == torch::kBFloat16)``), ``grouped_layout [M]`` int32,
#   contiguous: the group of each row of a. Both operands K-major; on sm_90 with fp32 scales it runs
#   sm90_m_grouped_fp8_gemm_contiguous_1d2d (the 1D2D kernel of scaled_mm, one weight per group).
# - contiguous layout (scheduler/gemm.cuh, MGroupedContiguous): an M block takes the group of its
#   first row (``grouped_layout[m_block_idx * BLOCK_M]``) and each 64-row math warpgroup is skipped
#   when its first row is < 0 (is_computation_valid). So every group's rows start at a multiple of
#   get_mk_alignment_for_contiguous_layout() (128 on sm_90, kLegacyMKAlignmentForContiguousLayout)
#   and are followed by -1 rows up to the next multiple, as DeepGEMM's own generator lays them out
#   (generate_m_grouped_contiguous: ``grouped_layout[actual_end:aligned_end] = -1``, a zeroed). What
#   the kernel writes to -1 rows is unspecified: they are never read here.
# - scales (transform_sf_into_required_layout, check_sf_layout): sfa fp32 [M, K/128] MN-major with
#   its column stride the TMA-aligned M (M rounded up to 4), built here directly in that layout so
#   the GEMM does not transpose it; sfb fp32 [G, N/128, K/128] contiguous (sm90_sfb_check with
#   num_groups), kernelmux's w1_scale/w2_scale as they are (``metadata`` runs the vendor's check).
# - sm_100 packs fp32 scales into UE8M0 by keeping their exponent bits (smxx_layout.cuh, the same
#   reasoning as scaled_mm.py): exact only for power-of-two scales, which the key cannot tell.
#
# Pipeline (all device ops; sizes from host ints, so no host sync anywhere):
# 1. route: local ids ``expert_map[topk_ids]`` (-1 off-rank); slots sorted by expert (stable), each
#    local slot given a row of its expert's aligned segment. The padded row count is only known on
#    the device, so the buffers take the upper bound M_max = P + min(E, P) * (A - 1) rows (P = T*k
#    slots, A the alignment), rounded up to A: the rows past the used segments are -1 and skipped.
# 2. the input (w * x in fp32 when the router weight goes on the input) is quantized 1 x 128 per
#    token with the spec's own quantize_fp8 (device-side torch, no sync) once per token and gathered
#    into the layout; padding rows take an extra all-zero token.
# 3. GEMM1 -> bf16 [M_max, 2I] (the spec rounds gate_up to the hidden dtype: the same point), the
#    activation in fp32 from it rounded to bf16, quantized 1 x 128 (quantize_fp8 again), GEMM2 ->
#    bf16 [M_max, H] (rounding each expert's output before the k-sum: inside FP8_TOLERANCE).
# 4. per slot its row of GEMM2's output (off-rank slots an extra zero row), times the router weight
#    in fp32, summed over k, rounded once to bf16.

import os
from typing import Any, Mapping, NamedTuple, Optional

import torch

from kernelmux.backends._vendor import first_calls
from kernelmux.backends.deepgemm import DEEPGEMM, arch_problem, transform_scales
from kernelmux.backends.deepgemm.scaled_mm import SCALE_ROWS
from kernelmux.platforms import Platform
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8

__all__ = ["CONFIRMED", "WeightScales", "fused_moe", "metadata", "prepare_weight_scales", "supports"]

BLOCK = spec.BLOCK
RECIPE = (1, BLOCK, BLOCK)  # 1 x 128 activation groups, 128 x 128 weight blocks: the 1D2D kernel
# The variants confirmed against the reference on a GPU (H100, tests-vendor at the commit that added them).
CONFIRMED: frozenset[str] = frozenset({"fp8_block"})


def variant(key: spec.Key) -> str:
    """The name CONFIRMED lists this call under."""
    return key.quantization


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when the two grouped GEMMs compute calls with this key as the spec defines them, else why not."""
    reason = arch_problem(platform)
    if reason is not None:
        return reason
    if key.quantization != "fp8_block":
        return (f"fp8_block only (DeepGEMM's 1D2D grouped GEMM takes 1 x 128 activation and 128 x 128 "
                f"weight block scales, recipe (1, 128, 128)), got quantization {key.quantization!r}")
    if key.weight_dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn weights only (DeepGEMM's check_grouped_ab_fp8_fp4), got {key.weight_dtype}"
    if key.hidden_dtype != torch.bfloat16:
        return (f"bf16 hidden only (m_grouped_fp8_gemm_nt_contiguous asserts a bf16 d, the point where "
                f"the spec rounds to the hidden dtype), got {key.hidden_dtype}")
    if key.hidden_size % BLOCK or key.intermediate_size % BLOCK:
        return (f"H and I multiples of {BLOCK} only (the K of both GEMMs: DeepGEMM's FP8 tests cover "
                f"K % 128 == 0 only, and the 1D2D kernel wants whole 128 x 128 weight blocks), got "
                f"H {key.hidden_size}, I {key.intermediate_size}")
    if variant(key) not in CONFIRMED:
        return (f"{variant(key)}: not yet confirmed against the reference on a GPU (confirm with "
                "perf/run_gpu.sh tests-vendor)")
    return None


class WeightScales(NamedTuple):
    """w1_scale and w2_scale in the layouts m_grouped_fp8_gemm_nt_contiguous reads (sm_90: contiguous
    [E, N/128, K/128]); a server converts them once at load."""

    w1: torch.Tensor
    w2: torch.Tensor


def prepare_weight_scales(w1_scale: torch.Tensor, w2_scale: torch.Tensor, hidden_size: int,
                          inter_size: int) -> WeightScales:
    """The weight-scale conversion, through DeepGEMM's own transform_sf_into_required_layout."""
    experts = w1_scale.shape[0]
    sf1 = transform_scales(w1_scale.contiguous(), mn=2 * inter_size, k=hidden_size, recipe=RECIPE,
                           num_groups=experts, is_sfa=False)
    sf2 = transform_scales(w2_scale.contiguous(), mn=hidden_size, k=inter_size, recipe=RECIPE,
                           num_groups=experts, is_sfa=False)
    return WeightScales(sf1, sf2)


def metadata(kwargs: Mapping[str, Any]) -> Any:
    """What a call does before its GEMMs that a server would do once, for the bench to time apart."""
    hidden, w1 = kwargs["hidden"], kwargs["w1"]
    if hidden.shape[0] == 0:
        return None
    return prepare_weight_scales(kwargs["w1_scale"], kwargs["w2_scale"], hidden.shape[1], w1.shape[1] // 2)


def _where() -> str:
    cache = os.environ.get("DG_JIT_CACHE_DIR") or "~/.deep_gemm (DG_JIT_CACHE_DIR moves it)"
    return f"JIT with nvcc (NVRTC if DG_JIT_USE_NVRTC=1) into DeepGEMM's cache {cache}"


class Layout(NamedTuple):
    """The contiguous layout of one call: per slot (token * k + j) its row (off-rank: ``rows``, an
    extra row past the GEMMs), per row its token (padding: ``T``, an extra zero token) and its
    expert (padding: -1)."""

    slot_rows: torch.Tensor  # [T * k] int64
    row_tokens: torch.Tensor  # [rows] int64
    m_indices: torch.Tensor  # [rows] int32, contiguous
    rows: int  # M_max


def contiguous_layout(local_ids: torch.Tensor, experts: int, alignment: int) -> Layout:
    """``local_ids [T, k]`` (-1 off-rank) laid out for m_grouped_fp8_gemm_nt_contiguous."""
    tokens, topk = local_ids.shape
    pairs = tokens * topk
    device = local_ids.device
    bound = pairs + min(experts, pairs) * (alignment - 1)
    rows = -(-bound // alignment) * alignment
    rows = -(-rows // SCALE_ROWS) * SCALE_ROWS  # sfa's TMA padding is then no extra row
    flat = local_ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, experts)  # off-rank sorts last, as group E
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    # Group E (off-rank) takes no rows; a new zero rather than padded[E] = 0, a host copy no graph captures.
    padded = torch.cat(((counts[:experts] + (alignment - 1)) // alignment * alignment, counts.new_zeros(1)))
    segment_start = torch.cumsum(padded, 0) - padded  # [E + 1]; group E starts at the used rows' end
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(pairs, device=device) - count_start[sorted_key]
    sorted_rows = torch.where(sorted_key < experts, segment_start[sorted_key] + rank, rows)
    slot_rows = torch.empty_like(sorted_rows)
    slot_rows[order] = sorted_rows
    # One spare row (index `rows`) takes every off-rank slot's writes; the GEMMs see rows [0, rows).
    row_tokens = torch.full((rows + 1,), tokens, dtype=torch.int64, device=device)
    row_tokens.scatter_(0, slot_rows, torch.arange(pairs, device=device) // topk)
    m_indices = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    m_indices.scatter_(0, slot_rows, key.to(torch.int32))
    return Layout(slot_rows, row_tokens[:rows], m_indices[:rows], rows)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's activation quantization: 1 x 128 groups, e4m3fn, fp32 scales [M, K/128]."""
    return quantize_fp8(x, "per_group", BLOCK, False, "e4m3fn")


def _mn_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale [M, G]`` (M a multiple of 4) as an MN-major copy with strides (1, M), the layout
    check_sf_layout's TMA check wants (a view of a contiguous [M, 1] has column stride 1, not M)."""
    rows, groups = scale.shape
    out = torch.empty_strided((rows, groups), (1, rows), dtype=scale.dtype, device=scale.device)
    return out.copy_(scale)


def fused_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
    quantization: str = "none",
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The spec's fused_moe on two m_grouped_fp8_gemm_nt_contiguous calls; arguments are validated by
    the caller and accepted by ``supports`` (fp8_block, e4m3fn, bf16 hidden, H and I % 128, sm_90)."""
    num_tokens, hidden_size = hidden.shape
    experts, two_inter, _ = w1.shape
    inter_size = two_inter // 2
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden.dtype, device=hidden.device)
    from deep_gemm import get_mk_alignment_for_contiguous_layout, m_grouped_fp8_gemm_nt_contiguous

    scales = prepare_weight_scales(w1_scale, w2_scale, hidden_size, inter_size)
    rhs1, rhs2 = w1.contiguous(), w2.contiguous()  # K-major, 16-byte rows (K % 128 == 0)
    ids = topk_ids if expert_map is None else expert_map.long()[topk_ids.long()]
    layout = contiguous_layout(ids, experts, int(get_mk_alignment_for_contiguous_layout()))
    rows = layout.rows

    x = hidden.float()
    weights = topk_weights.float()
    if apply_router_weight_on_input:  # k == 1 (validate): the spec weights the input in fp32
        x = x * weights
        weights = torch.ones_like(weights)
    codes, scale = _quantize(x)
    # Row T: an all-zero token for the padding rows (codes 0, scale 1: finite, as DeepGEMM's tests).
    codes = torch.cat((codes.view(torch.uint8), codes.new_zeros((1, hidden_size)).view(torch.uint8)))
    scale = torch.cat((scale, scale.new_ones((1, scale.shape[1]))))
    a1 = codes[layout.row_tokens].view(torch.float8_e4m3fn)
    sfa1 = scale.t().index_select(1, layout.row_tokens).t()  # [rows, H/128], strides (1, rows)

    gate_up = torch.empty((rows, two_inter), dtype=torch.bfloat16, device=hidden.device)
    _gemm(m_grouped_fp8_gemm_nt_contiguous, (a1, sfa1), (rhs1, scales.w1), gate_up, layout.m_indices,
          ("gate_up", two_inter, hidden_size, experts))
    gate, up = gate_up[:, :inter_size].float(), gate_up[:, inter_size:].float()
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate)
    codes2, scale2 = _quantize((act * up).to(torch.bfloat16))

    # One row more than the GEMM sees: the zero row that every off-rank slot reads.
    down = torch.empty((rows + 1, hidden_size), dtype=torch.bfloat16, device=hidden.device)
    down[rows].zero_()
    _gemm(m_grouped_fp8_gemm_nt_contiguous, (codes2, _mn_major(scale2)), (rhs2, scales.w2), down[:rows],
          layout.m_indices, ("down", hidden_size, inter_size, experts))
    per_slot = down[layout.slot_rows].view(num_tokens, -1, hidden_size).float()
    return (per_slot * weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


def _gemm(gemm, a, b, d, m_indices, shape) -> None:
    def call():
        # compiled_dims "nk" (the vendor's default for its grouped GEMMs, named so a default change
        # cannot alter which kernels are built): one kernel per (N, K) and group count.
        gemm(a=a, b=b, d=d, grouped_layout=m_indices, recipe=RECIPE, compiled_dims="nk")

    first_calls.run(DEEPGEMM, spec.NAME, shape, _where() + "; another M may pick another block shape "
                    "and compile again", call)
