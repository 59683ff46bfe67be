"""The cuda kernels' named ABI: one ctypes mirror per params struct of the .cu files (the same
fields, in order, of the same types), and the static_asserts appended to each compiled source
that hold the kernel's parameter list, its struct and the mirror to one list of types. A launch
points the driver at each field of the mirror (_driver.Kernel.parameters)."""

from __future__ import annotations

import ctypes
from typing import Sequence

from kernelmux.backends.cuda._driver import TensorMap
from kernelmux.backends.cuda._toolchain import KERNELS

__all__ = ["Fp4MmParams", "MergeSplitsParams", "MlaDecodeParams", "MoeDecodeDownParams", "MoeDecodeFp4DownParams",
           "MoeDecodeFp4GateUpParams", "MoeDecodeGateUpParams", "MoeGemmParams", "MoeRouteParams", "MoeSumParams",
           "PagedDecodeParams", "PagedPrefillParams", "QuantizeFp4Params", "QuantizeGroupsParams", "QuantizeRowsParams",
           "ScaledMmParams", "abi_checks", "checked_source"]

# Why the kernels keep positional parameters (launched with a pointer to each field of the mirror)
# instead of taking the struct by value: by value, the pointers lose __restrict__, and ptxas emitted
# other SASS (ld.global.nc lost, prefill and MLA rescheduled), which perf/decisions/paged_attention.md's
# tuning did not measure.
_P, _I, _Q, _F, _M = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, TensorMap
_KINDS = {_P: "p", _I: "i", _Q: "q", _F: "f", _M: "m"}
_KIND_NAMES = {_P: "pointer", _I: "int32", _Q: "int64", _F: "float32", _M: "TMA tensor map"}
# A TensorMap's alignment in C (alignas(64)): a struct holding one pads its size to a multiple of it, which
# ctypes does not (the launch passes fields, not the struct).
_MAP_ALIGNMENT = 64


def _fields(pointers: str, ints: str, floats: str, longs: str, maps: str = "") -> list[tuple[str, type]]:
    """Fields in the .cu struct's order, as its declarations group them: TMA maps, pointers, then
    int32s, then floats, then int64s."""
    groups = ((maps, _M), (pointers, _P), (ints, _I), (floats, _F), (longs, _Q))
    return [(name, kind) for names, kind in groups for name in names.split()]


def _c_size(mirror: type[ctypes.Structure]) -> int:
    """sizeof of the .cu struct ``mirror`` mirrors: its own size, padded as C pads a struct with a map."""
    size = ctypes.sizeof(mirror)
    if any(kind is _M for _, kind in mirror._fields_):
        size = -(-size // _MAP_ALIGNMENT) * _MAP_ALIGNMENT
    return size


class PagedDecodeParams(ctypes.Structure):
    """kernels/paged_decode_fp8.cu's PagedDecodeParams (the decode kernel)."""

    _fields_ = _fields(
        "query k_cache v_cache out part_acc part_ml cu_seqlens_q block_table seq_lens sinks k_scale v_scale",
        "num_tokens num_q_heads group num_splits window launch_next_early warm_start table_width "
        "num_cache_blocks",
        "scale soft_cap",
        "q_stride_t q_stride_h o_stride_t o_stride_h k_stride_b k_stride_s k_stride_h v_stride_b v_stride_s "
        "v_stride_h table_stride")


class MergeSplitsParams(ctypes.Structure):
    """kernels/split_kv_merge.cuh's MergeSplitsParams (the split-KV merge of both decode kernels)."""

    _fields_ = _fields("out lse part_acc part_ml sinks", "num_tokens num_heads num_splits launch_next_early", "",
                       "o_stride_t o_stride_h")


class PagedPrefillParams(ctypes.Structure):
    """kernels/paged_prefill_sm90.cu's PagedPrefillParams."""

    _fields_ = _fields(
        "query k_cache v_cache out cu_seqlens_q block_table seq_lens sinks",
        "group page_shift causal window",
        "scale_log2 soft_cap",
        "q_stride_t q_stride_h o_stride_t o_stride_h k_stride_b k_stride_p k_stride_h v_stride_b v_stride_p "
        "v_stride_h table_stride")


class MlaDecodeParams(ctypes.Structure):
    """kernels/mla_decode_sm90.cu's MlaDecodeParams (the MLA decode kernel)."""

    _fields_ = _fields(
        "q kv out lse part_acc part_ml cu_seqlens_q block_table seq_lens kv_scale",
        "num_seqs num_tokens num_heads num_splits block_size q_per_seq",
        "scale_log2",
        "q_stride_t q_stride_h o_stride_t o_stride_h kv_stride_b kv_stride_p table_stride")


class MoeRouteParams(ctypes.Structure):
    """kernels/fused_moe_sm90.cu's MoeRouteParams (the routing CTA)."""

    _fields_ = _fields("topk_ids expert_map counts starts block_expert sorted_pairs",
                       "num_pairs topk num_experts max_blocks", "", "ids_stride_t ids_stride_k map_stride")


class MoeGemmParams(ctypes.Structure):
    """kernels/fused_moe_sm90.cu's MoeGemmParams (gate-up and down)."""

    _fields_ = _fields("a out sorted_pairs block_expert starts counts topk_weights a_scale b_scale out_scale",
                       "topk n_size k_size max_blocks", "",
                       "a_stride out_stride weights_stride_t weights_stride_k a_scale_stride b_scale_stride_e "
                       "b_scale_stride_n b_scale_stride_k out_scale_stride", maps="b_map")


class MoeSumParams(ctypes.Structure):
    """kernels/fused_moe_sm90.cu's MoeSumParams (the top-k sum)."""

    _fields_ = _fields("pairs topk_ids expert_map out", "hidden_size topk", "",
                       "pairs_stride ids_stride_t ids_stride_k map_stride out_stride")


class MoeDecodeGateUpParams(ctypes.Structure):
    """kernels/fused_moe_decode.cu's MoeDecodeGateUpParams (the gate-up GEMV)."""

    _fields_ = _fields("hidden w1 inter topk_ids expert_map topk_weights",
                       "num_pairs topk inter_size hidden_size on_input", "",
                       "hidden_stride w1_stride_e w1_stride_n inter_stride ids_stride_t ids_stride_k map_stride "
                       "weights_stride_t")


class MoeDecodeDownParams(ctypes.Structure):
    """kernels/fused_moe_decode.cu's MoeDecodeDownParams (the down GEMV)."""

    _fields_ = _fields("inter w2 out topk_ids expert_map topk_weights",
                       "num_tokens topk hidden_size inter_size on_input", "",
                       "inter_stride w2_stride_e w2_stride_n out_stride ids_stride_t ids_stride_k map_stride "
                       "weights_stride_t weights_stride_k")


class MoeDecodeFp4GateUpParams(ctypes.Structure):
    """kernels/fused_moe_decode.cu's MoeDecodeFp4GateUpParams (the gate-up GEMV of fp4 experts)."""

    _fields_ = _fields("hidden w1 w1_scale w1_global inter topk_ids expert_map topk_weights",
                       "num_pairs topk inter_size hidden_size on_input", "",
                       "hidden_stride w1_stride_e w1_stride_n scale_stride_e scale_stride_n scale_stride_k "
                       "global_stride inter_stride ids_stride_t ids_stride_k map_stride weights_stride_t")


class MoeDecodeFp4DownParams(ctypes.Structure):
    """kernels/fused_moe_decode.cu's MoeDecodeFp4DownParams (the down GEMV of fp4 experts)."""

    _fields_ = _fields("inter w2 w2_scale w2_global out topk_ids expert_map topk_weights",
                       "num_tokens topk hidden_size inter_size on_input", "",
                       "inter_stride w2_stride_e w2_stride_n scale_stride_e scale_stride_n scale_stride_k "
                       "global_stride out_stride ids_stride_t ids_stride_k map_stride weights_stride_t "
                       "weights_stride_k")


class Fp4MmParams(ctypes.Structure):
    """kernels/fp4_mm.cu's Fp4MmParams (the W4A16 GEMV of up to 32 rows)."""

    _fields_ = _fields("a b b_scale b_global out", "m n k", "",
                       "a_stride b_stride scale_stride_n scale_stride_k out_stride")


class QuantizeGroupsParams(ctypes.Structure):
    """kernels/quantize_fp8.cu's QuantizeGroupsParams (per_group)."""

    _fields_ = _fields("x q scale", "rows cols groups tasks_per_row row_shift", "",
                       "row_magic x_stride q_stride scale_stride_m scale_stride_g")


class QuantizeRowsParams(ctypes.Structure):
    """kernels/quantize_fp8.cu's QuantizeRowsParams (per_token and per_tensor)."""

    _fields_ = _fields("x q scale partials", "rows cols rows_per_cta num_partials", "",
                       "x_stride q_stride scale_stride")


class QuantizeFp4Params(ctypes.Structure):
    """kernels/quantize_fp4.cu's QuantizeFp4Params (quantize_nvfp4 and quantize_mxfp4)."""

    _fields_ = _fields("x q scale gs_in gs_out partials", "rows blocks tasks_per_row row_shift num_partials", "",
                       "row_magic x_stride q_stride scale_stride")


class ScaledMmParams(ctypes.Structure):
    """kernels/scaled_mm_sm90.cu's ScaledMmParams (block-scaled fp8 GEMM)."""

    _fields_ = _fields("scale_a scale_b bias out", "m n k", "",
                       "scale_a_stride_m scale_a_stride_k scale_b_stride_n scale_b_stride_k bias_stride out_stride",
                       maps="a_map b_map")


def abi_checks(mirror: type[ctypes.Structure], kernels: Sequence[str]) -> str:
    """C++ static_asserts that the struct named like ``mirror`` has the mirror's size and, field by
    field, its names, sizes and kinds, and that each kernel of ``kernels`` (C++ name expressions)
    takes exactly those fields' types as its parameters, in the mirror's order. The struct's offsets
    then follow by the same C layout rules on both sides (NVRTC has no constant offsetof); the
    parameters' own offsets are the cubin's, where the driver copies each field to."""
    struct = mirror.__name__
    lines = [f'static_assert(sizeof({struct}) == {_c_size(mirror)}, "{struct}: its size differs from its '
             f'host mirror\'s ({_c_size(mirror)} bytes, backends/cuda/_params.py)");']
    for name, kind in mirror._fields_:
        size = getattr(mirror, name).size
        lines.append(
            f"static_assert(sizeof({struct}::{name}) == {size} && kernelmux_abi::Kind<decltype({struct}::{name})>"
            f"::value == '{_KINDS[kind]}', \"{struct}.{name}: the host mirror (backends/cuda/_params.py) has a "
            f"{_KIND_NAMES[kind]} here\");")
    types = ", ".join(f"decltype({struct}::{name})" for name, _ in mirror._fields_)
    for kernel in kernels:
        lines.append(f"static_assert(kernelmux_abi::Same<decltype(&{kernel}), void (*)({types})>::value, "
                     f'"{kernel}: its parameters are not the fields of {struct}, in order");')
    return "\n".join(lines) + "\n"


def checked_source(filename: str, checks: Sequence[tuple[type[ctypes.Structure], Sequence[str]]]) -> str:
    """kernels/``filename`` with abi_checks appended for each (mirror, kernels) of ``checks``;
    the file's own lines keep their numbers."""
    text = (KERNELS / filename).read_text()
    return text + "\n// Appended by backends/cuda/_params.py: the named ABI's checks.\n" + "".join(
        abi_checks(mirror, kernels) for mirror, kernels in checks)
