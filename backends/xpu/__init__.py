"""The xpu backend: Intel's vllm-xpu-kernels (SYCL and oneDNN kernels registered as torch ops, and its
Python wrappers) behind kernelmux's specs, called by keyword through the vendor mechanism
(backends/_vendor.py). One module per op; all dry-run only (against tests/vendors/vllm_xpu_kernels)."""

from __future__ import annotations

import importlib
from typing import Optional

from kernelmux.backends._table import Defaults, Entry, Gap, implementations
from kernelmux.backends._vendor import Vendor, VendorCall
from kernelmux.platforms import PlatformKind
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl

__all__ = ["CALLS", "DECLINED", "TABLE", "XPU_KERNELS", "kernelmux_implementations"]

XPU_KERNELS = Vendor(
    name="vllm_xpu_kernels",
    distribution="vllm-xpu-kernels",
    # 0.1.16.x: the release whose wheel (0.1.16.2, PyPI) was read; each release is built against one
    # torch-xpu (0.1.16 for torch 2.14.0+xpu, its README), so the range stays one release wide.
    tested=((0, 1, 16), (0, 1, 17)),
    extra="xpu",
)


# The compiled extensions, each imported for the torch ops its import registers: ``import
# vllm_xpu_kernels`` loads only the flash-attention one (vllm_xpu_kernels/__init__.py); vLLM imports
# ``vllm_xpu_kernels._C`` and the others itself. Probing the import first turns a missing libsycl or a
# torch-xpu ABI mismatch into the op's reason, instead of an AttributeError from ``torch.ops``.
_C = VendorCall("vllm_xpu_kernels._C")
_MOE_C = VendorCall("vllm_xpu_kernels._moe_C")
_XPU_C = VendorCall("vllm_xpu_kernels._xpu_C")
_FA2_C = VendorCall("vllm_xpu_kernels._vllm_fa2_C")

# Per op, the vendor functions its entry module calls and the keywords it passes (a torch op's are its
# schema's argument names), probed at startup as that op's static check, each after the extension that
# registers it; schemas as read from the 0.1.16.2 wheel's .so files.
CALLS: dict[str, tuple[VendorCall, ...]] = {
    "grouped_topk": (
        _MOE_C,
        VendorCall("torch", "ops._moe_C.grouped_topk",
                   ("scores", "n_group", "topk_group", "topk", "renormalize", "routed_scaling_factor", "bias",
                    "scoring_func")),
    ),
    "fused_moe": (
        _C, _MOE_C, _XPU_C,
        VendorCall("vllm_xpu_kernels.fused_moe_interface", "XpuFusedMoe",
                   ("w13", "w13_scales", "w13_bias", "w2", "w2_scales", "w2_bias", "n_experts_per_token",
                    "activation", "num_experts", "expert_map")),
        VendorCall("vllm_xpu_kernels.fused_moe_interface", "XpuFusedMoe.apply",
                   ("output", "hidden_states", "topk_weights", "topk_ids", "expert_map")),
        # What XpuFusedMoe.apply runs for 16-bit experts (fused_moe_interface.py _apply_kernel).
        VendorCall("torch", "ops._moe_C.remap_hidden_states", ()),
        VendorCall("torch", "ops._xpu_C.cutlass_grouped_gemm_interface", ()),
        VendorCall("torch", "ops._C.silu_and_mul", ()),
        VendorCall("torch", "ops._C.gelu_and_mul", ()),
        VendorCall("torch", "ops._moe_C.moe_gather", ()),
    ),
    "paged_attention": (
        # flash_attn_interface.py imports it under try/except ImportError: probed, or a broken one would
        # surface only at the first call.
        _FA2_C,
        VendorCall("vllm_xpu_kernels", "flash_attn_varlen_func",
                   ("q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "softmax_scale",
                    "causal", "window_size", "block_table", "out", "k_descale", "v_descale", "s_aux",
                    "is_mix_batch")),
        VendorCall("torch", "ops._vllm_fa2_C.varlen_fwd", ()),
    ),
    "kv_cache_write": (
        _C,
        VendorCall("torch", "ops._C.reshape_and_cache_flash",
                   ("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale",
                    "v_scale")),
    ),
    "scaled_mm": (
        _XPU_C,
        VendorCall("torch", "ops._xpu_C.fp8_gemm", ("A", "B", "out_dtype", "A_scale_", "B_scale_", "bias_")),
    ),
    "fp4_mm": (
        _XPU_C,
        VendorCall("torch", "ops._xpu_C.fp4_gemm", ("A", "B", "A_scale", "B_scale", "out_dtype", "bias_")),
    ),
    "quantize_fp8": (
        _C,
        VendorCall("torch", "ops._C.dynamic_scaled_fp8_quant", ("result", "input", "scale")),
        VendorCall("torch", "ops._C.dynamic_per_token_scaled_fp8_quant", ("result", "input", "scale", "scale_ub")),
        VendorCall("torch", "ops._C.per_token_group_fp8_quant",
                   ("input", "output_q", "output_s", "group_size", "eps", "fp8_min", "fp8_max", "scale_ue8m0",
                    "dummy_is_scale_transposed", "dummy_is_tma_aligned")),
    ),
    "quantize_mxfp4": (
        _C,
        VendorCall("torch", "ops._C.per_token_group_quant_mxfp4",
                   ("input", "output_q", "output_s", "group_size", "eps")),
    ),
}

# Ops whose vendor kernel is wired but computes something else than the spec for every input class (its
# arithmetic, not a limit of shapes): rejected statically with the reason its entry module gives, so
# `kernelmux info` does not list them as served. The reasons live beside the code they describe.
DECLINED = ("quantize_fp8", "quantize_mxfp4")

# Above the triton backend's XPU target (20): these are the SYCL and oneDNN kernels vLLM runs on Intel
# GPUs; unmeasured here (no XPU machine), so the order is by provenance, not by a bench.
_DEFAULTS = Defaults(
    priority=25,
    requirement=PlatformRequirement(kinds=frozenset({PlatformKind.XPU})),
    devices=frozenset({"xpu"}),
)

TABLE: tuple[Entry | Gap, ...] = (
    Entry("grouped_topk",
          "_moe_C.grouped_topk (fused group-limited top-k): sigmoid fused for fp32 logits, softmax or bf16/fp16 "
          "logits scored in fp32 first; n_group and topk <= 32; without a bias only when every group is kept; "
          "dry-run only"),
    Entry("fused_moe",
          "XpuFusedMoe (remap_hidden_states, Xe2 cutlass grouped GEMMs, silu/gelu_and_mul, moe_gather): 16-bit "
          "experts, topk in {1, 2, 4, 6, 7, 8, 10, 16}, H and 2I % 8; weights transposed to [E, K, N] per "
          "call; dry-run only"),
    Entry("paged_attention",
          "flash_attn_varlen_func on the block table (chunk-prefill and split-K paged-decode kernels): head "
          "dims 64-512, block sizes % 16, fp8 e4m3 caches with per-tensor scales, sliding window, sinks "
          "(bf16 queries); no soft cap; dry-run only"),
    Entry("kv_cache_write",
          "_C.reshape_and_cache_flash (\"auto\" or \"fp8_e4m3\", true division, saturating); other cache "
          "layouts written per kv head; dry-run only"),
    Entry("scaled_mm",
          "_xpu_C.fp8_gemm (oneDNN): e4m3fn, bf16/fp16 out, per-tensor, per-token x per-channel, 128-block "
          "scales (K and N % 128), bias; dry-run only"),
    Entry("fp4_mm",
          "_xpu_C.fp4_gemm (oneDNN): MXFP4 W4A4, bf16/fp16 out; dry-run only"),
    Entry("quantize_fp8",
          "_C.dynamic_scaled_fp8_quant / dynamic_per_token_scaled_fp8_quant / per_token_group_fp8_quant: "
          "wired and declined (reciprocal-multiply codes, other scale floors); dry-run only"),
    Entry("quantize_mxfp4",
          "_C.per_token_group_quant_mxfp4: wired and declined (ties rounded down, eps-floored zero blocks); "
          "dry-run only"),
    Gap("quantize_nvfp4",
        "vllm-xpu-kernels 0.1.16.2 has no NVFP4 kernel (its FP4 is MXFP4 with e8m0 scales: fp4_gemm, "
        "per_token_group_quant_mxfp4)"),
    Gap("selective_state_update",
        "vllm-xpu-kernels 0.1.16.2 has no Mamba2 selective-state kernel (only gated-delta-rule ops)"),
    Gap("ssd_scan",
        "vllm-xpu-kernels 0.1.16.2 has no Mamba2 SSD kernel (only gated-delta-rule ops)"),
)


def _static_check(op: str):
    """The op's static check: the vendor and its calls, then, for a DECLINED op, its entry's reason."""
    calls = CALLS[op]
    if op not in DECLINED:
        return XPU_KERNELS.static_check(calls)

    def check(platform) -> Optional[str]:
        reason = XPU_KERNELS.problem_for(calls)
        if reason is not None:
            return reason
        return importlib.import_module(f"{__name__}.{op}").DECLINED

    return check


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    # The installed version leads each description, so `kernelmux info` and the report name it.
    version = f"{XPU_KERNELS.distribution} {XPU_KERNELS.version() or '(not installed)'}: "
    table = [entry if isinstance(entry, Gap) else
             Entry(entry.op, version + entry.description, {"static_check": _static_check(entry.op), **entry.overrides})
             for entry in TABLE]
    return implementations(Backend.XPU, __name__, _DEFAULTS, table)
