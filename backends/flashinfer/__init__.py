"""The flashinfer backend: FlashInfer's own kernels (flashinfer-python, JIT-compiled with nvcc at
first use) behind kernelmux's specs, called by keyword through the vendor mechanism (backends/_vendor.py).
One module per op; _paged.py holds what the paged-attention entry points share."""

from __future__ import annotations

import os

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends._vendor import Vendor, VendorCall
from kernelmux.platforms import Feature, PlatformKind
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl

FLASHINFER = Vendor(
    name="flashinfer",
    distribution="flashinfer-python",
    tested=((0, 6, 14), (0, 7)),  # 0.6.14: the version measured on the H100 (its wheel fits the device carry)
)

# Per op, the vendor functions its entry module calls and the keywords it passes: probed at startup
# as that op's static check, so an API change rejects the ops that use it, not the backend.
CALLS: dict[str, tuple[VendorCall, ...]] = {
    "grouped_topk": (
        VendorCall("flashinfer.fused_moe", "fused_topk_deepseek",
                   ("scores", "bias", "n_group", "topk_group", "topk", "routed_scaling_factor", "topk_values",
                    "topk_indices")),
    ),
    "fused_moe": (
        VendorCall("flashinfer.fused_moe", "cutlass_fused_moe",
                   ("input", "token_selected_experts", "token_final_scales", "fc1_expert_weights",
                    "fc2_expert_weights", "output_dtype", "quant_scales", "output",
                    "use_deepseek_fp8_block_scale", "activation_type")),
        VendorCall("flashinfer.fused_moe", "ActivationType.Swiglu", ()),
        VendorCall("flashinfer.fused_moe", "ActivationType.Geglu", ()),
        VendorCall("flashinfer.fused_moe", "trtllm_bf16_routed_moe",
                   ("topk_ids", "hidden_states", "gemm1_weights", "gemm2_weights", "num_experts", "top_k", "n_group",
                    "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
                    "routed_scaling_factor", "routing_method_type", "use_shuffled_weight", "weight_layout",
                    "do_finalize", "activation_type", "output")),
        VendorCall("flashinfer.fused_moe", "trtllm_fp8_block_scale_routed_moe",
                   ("topk_ids", "routing_bias", "hidden_states", "hidden_states_scale", "gemm1_weights",
                    "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale", "num_experts", "top_k", "n_group",
                    "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
                    "routed_scaling_factor", "routing_method_type", "use_shuffled_weight", "weight_layout",
                    "do_finalize", "output", "fp8_quantization_type", "activation_type")),
        VendorCall("flashinfer.fused_moe", "RoutingMethodType.TopK", ()),
        VendorCall("flashinfer.fused_moe", "WeightLayout.BlockMajorK", ()),
        VendorCall("flashinfer.fused_moe", "WeightLayout.MajorK", ()),
        VendorCall("flashinfer.fused_moe", "Fp8QuantizationType.DeepSeekFp8", ()),
    ),
    "paged_attention": (
        VendorCall("flashinfer.decode", "trtllm_batch_decode_with_kv_cache",
                   ("query", "kv_cache", "workspace_buffer", "block_tables", "seq_lens", "max_seq_len", "bmm1_scale",
                    "bmm2_scale", "window_left", "out", "sinks", "kv_layout", "backend")),
        VendorCall("flashinfer.prefill", "BatchPrefillWithPagedKVCacheWrapper",
                   ("float_workspace_buffer", "kv_layout")),
        VendorCall("flashinfer.prefill", "BatchPrefillWithPagedKVCacheWrapper.plan",
                   ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                    "num_kv_heads", "head_dim_qk", "page_size", "causal", "sm_scale", "window_left",
                    "logits_soft_cap", "q_data_type", "kv_data_type")),
    ),
    "mla_decode": (
        VendorCall("flashinfer.mla", "BatchMLAPagedAttentionWrapper", ("float_workspace_buffer",)),
        VendorCall("flashinfer.mla", "BatchMLAPagedAttentionWrapper.plan",
                   ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
                    "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")),
        VendorCall("flashinfer.mla", "BatchMLAPagedAttentionWrapper.run",
                   ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "return_lse", "return_lse_base_on_e")),
        VendorCall("flashinfer.mla", "trtllm_batch_decode_with_kv_cache_mla",
                   ("query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                    "block_tables", "seq_lens", "max_seq_len", "bmm1_scale", "bmm2_scale", "backend", "return_lse",
                    "cum_seq_lens_q", "max_q_len")),
    ),
    "scaled_mm": (
        VendorCall("flashinfer.gemm", "fp8_blockscale_gemm_sm90",
                   ("input", "weight", "input_scale", "weight_scale", "out", "out_dtype")),
        VendorCall("flashinfer.gemm", "gemm_fp8_nt_groupwise",
                   ("a", "b", "a_scale", "b_scale", "scale_major_mode", "mma_sm", "scale_granularity_mnk", "out",
                    "backend")),
    ),
    "selective_state_update": (
        VendorCall("flashinfer.mamba", "selective_state_update",
                   ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "state_batch_indices",
                    "pad_slot_id", "out", "algorithm")),
    ),
    "fp4_mm": (
        VendorCall("flashinfer.gemm", "mm_fp4",
                   ("a", "b", "a_descale", "b_descale", "alpha", "out_dtype", "out", "block_size", "use_nvfp4",
                    "backend")),
    ),
}
_FP4_QUANTIZE = (
    VendorCall("flashinfer.fp4_quantization", "fp4_quantize",
               ("input", "global_scale", "sf_vec_size", "sf_use_ue8m0", "is_sf_swizzled_layout")),
)
CALLS["quantize_nvfp4"] = CALLS["quantize_mxfp4"] = _FP4_QUANTIZE


def _jit_dir() -> str:
    """FlashInfer's JIT cache: $FLASHINFER_WORKSPACE_BASE (default ~)/.cache/flashinfer."""
    return os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~"), ".cache", "flashinfer")


# Below kernelmux's own triton and cuda kernels until selection by measurement decides per op.
_DEFAULTS = Defaults(
    priority=15,
    requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA})),
    devices=frozenset({"cuda"}),
    jit=JitCache("FlashInfer JIT (nvcc)", _jit_dir, "one module per kernel family, dtype and head dim"),
)

TABLE = (
    Entry("grouped_topk",
          "fused_topk_deepseek: sigmoid + bias, group top-2 sums, top-k, renormalized and scaled, one kernel "
          "(sm_89, sm_90, sm_100, sm_103, sm_120, sm_121)"),
    Entry("fused_moe",
          "cutlass_fused_moe: bf16/fp16 experts (sm_89-sm_121), DeepSeek fp8 128-block weights with 1x128 "
          "activations (sm_90); w1's gate/up halves swapped per call. On sm_100/sm_103 trtllm_bf16_routed_moe "
          "(bf16, silu, H and I % 128; weights shuffled and blocked per call, routing packed with bf16 weights) "
          "and trtllm_fp8_block_scale_routed_moe (declined: e4m3 gate/up), wired, dry-run only. Declined until "
          "confirmed on a GPU"),
    Entry("paged_attention",
          "decode of 16-bit caches: xqa (trtllm_batch_decode_with_kv_cache) on the block table; prefill: "
          "BatchPrefillWithPagedKVCacheWrapper (fa3 on sm_90, fa2 elsewhere), planned per call"),
    Entry("mla_decode",
          "BatchMLAPagedAttentionWrapper (fa3 on sm_90, fa2 elsewhere) on the c_kv / k_pe views of 16-bit caches, "
          "planned per call; on sm_100/103 and sm_120/121 trtllm_batch_decode_with_kv_cache_mla (trtllm-gen, "
          "xqa) on the block table, bf16 only, no plan (graph-capturable)"),
    Entry("scaled_mm",
          "block scales (1x128 x 128x128), e4m3fn, no bias: fp8_blockscale_gemm_sm90 on sm_90 (bf16 out, "
          "N % 64, K % 128); gemm_fp8_nt_groupwise (CUTLASS) on sm_100/103/120/121 (bf16/fp16 out)",
          {"priority": 16}),  # between deepgemm and torch, as measured (perf/decisions/scaled_mm.md)
    Entry("selective_state_update",
          "flashinfer.mamba.selective_state_update on broadcast views of A, D, dt, dt_bias (N 32/64/128/256; "
          "'auto' kernel choice for P 64/128, 'simple' otherwise)"),
    Entry("fp4_mm",
          "mm_fp4, W4A4 only, bf16/fp16 out, N and K % 32: NVFP4 on CUTLASS/cuDNN, MXFP4 on cuDNN (sm_100, "
          "sm_103); scales swizzled to 128x4 per call",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                              features=frozenset({Feature.FP4_MMA}))}),
    Entry("quantize_nvfp4",
          "fp4_quantize (sf_vec_size 16, linear scales): declined, its scale arithmetic is not the spec's",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                              features=frozenset({Feature.FP4_MMA}))}),
    Entry("quantize_mxfp4",
          "fp4_quantize (sf_vec_size 32, ue8m0, linear scales): 'ceil' scales, bf16/fp16 input",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                              features=frozenset({Feature.FP4_MMA}))}),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    # The installed version leads each description, so `kernelmux info` and the report name it.
    version = f"{FLASHINFER.distribution} {FLASHINFER.version() or '(not installed)'}: "
    table = [Entry(entry.op, version + entry.description,
                   {"static_check": FLASHINFER.static_check(CALLS[entry.op]), **entry.overrides})
             for entry in TABLE]
    return implementations(Backend.FLASHINFER, __name__, _DEFAULTS, table)
