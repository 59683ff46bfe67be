"""The aiter backend: AMD's AITER kernels (amd-aiter, imported as ``aiter``) on ROCm behind
kernelmux's specs, called by keyword through the vendor mechanism (backends/_vendor.py). One module
per op; every entry is dry-run only: written against aiter's source, tested against a fake aiter."""

from __future__ import annotations

import importlib.util
import os

from kernelmux.backends._table import Defaults, Entry, Gap, implementations
from kernelmux.backends._vendor import Vendor, VendorCall
from kernelmux.platforms import PlatformKind
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl

AITER = Vendor(
    name="aiter",
    distribution="amd-aiter",
    # Read at ROCm/aiter e4048607 (setuptools_scm: 0.1.21.dev46), whose sources of every API used
    # here match the v0.1.20 tag but for fused_moe's internals. PyPI's 0.1.7.post2.dev18 is older.
    tested=((0, 1, 20), (0, 1, 22)),
    extra="aiter",
)
WHERE = ("JIT with hipcc into aiter's module dir ($AITER_JIT_DIR, else aiter/jit if writable, "
         "else ~/.aiter/jit)")


def _compiled(function: str, keywords: tuple[str, ...]) -> tuple[VendorCall, VendorCall]:
    """The calls of one of aiter's compiled entry points. aiter.jit's compile_ops and
    torch_compile_guard (jit/utils/torch_guard.py) return ``wrapper_custom(*args, **kwargs)``,
    which forwards to ``torch.ops.aiter.<function>``: the Python name is probed for presence, the
    op's schema (inferred from aiter's Python stub) for the keywords."""
    return (VendorCall("aiter", function, keywords),
            VendorCall("torch", f"ops.aiter.{function}", keywords))


# Per op, the vendor functions its entry module calls and the keywords it passes: probed at startup
# as that op's static check, so an API change rejects the ops that use it, not the backend.
CALLS: dict[str, tuple[VendorCall, ...]] = {
    "grouped_topk": (
        *_compiled("biased_grouped_topk_hip",
                   ("gating_output", "correction_bias", "topk_weights", "topk_ids", "num_expert_group", "topk_grp",
                    "need_renorm", "routed_scaling_factor")),
        *_compiled("grouped_topk",
                   ("gating_output", "topk_weights", "topk_ids", "num_expert_group", "topk_group", "need_renorm",
                    "is_softmax", "routed_scaling_factor")),
    ),
    "fused_moe": (
        VendorCall("aiter.fused_moe", "fused_moe",
                   ("hidden_states", "w1", "w2", "topk_weight", "topk_ids", "expert_mask", "activation",
                    "quant_type", "doweight_stage1", "w1_scale", "w2_scale", "a1_scale", "a2_scale", "dtype")),
        VendorCall("aiter.ops.shuffle", "shuffle_weight", ("x", "layout")),
        VendorCall("aiter", "ActivationType.Silu", ()),
        VendorCall("aiter", "ActivationType.Gelu", ()),
        VendorCall("aiter", "QuantType.No", ()),
        VendorCall("aiter", "QuantType.per_128x128", ()),
    ),
    "paged_attention": (
        VendorCall("aiter", "flash_attn_varlen_func",
                   ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                    "logits_soft_cap", "causal", "window_size", "block_table", "out")),
    ),
    "mla_decode": (
        VendorCall("aiter.mla", "mla_decode_fwd",
                   ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                    "max_seqlen_q", "page_size", "nhead_kv", "sm_scale", "logit_cap", "return_lse", "causal")),
    ),
    "scaled_mm": (
        *_compiled("gemm_a8w8_blockscale", ("XQ", "WQ", "x_scale", "w_scale", "dtype")),
        *_compiled("gemm_a8w8", ("XQ", "WQ", "x_scale", "w_scale", "bias", "dtype", "splitK")),
    ),
    "quantize_fp8": (
        *_compiled("dynamic_per_token_scaled_quant", ("out", "input", "scales")),
    ),
    "fp4_mm": (
        *_compiled("gemm_a4w4", ("A", "B", "A_scale", "B_scale", "dtype", "bpreshuffle")),
        VendorCall("aiter.ops.shuffle", "shuffle_weight", ("x", "layout")),
        VendorCall("aiter.utility.fp4_utils", "e8m0_shuffle", ("scale",)),
    ),
    "quantize_mxfp4": (
        VendorCall("aiter.utility.fp4_utils", "dynamic_mxfp4_quant", ("x", "scaling_mode", "shuffle")),
    ),
}

# The archs whose kernels (hsa/gfx942, hsa/gfx950, CK instances) the adapters were written for.
ARCHS = frozenset({"gfx942", "gfx950"})
_ROCM = PlatformRequirement(kinds=frozenset({PlatformKind.ROCM}), archs=ARCHS)


def _jit_dir() -> str:
    """aiter's module dir: $AITER_JIT_DIR, else aiter/jit in its package if writable, else ~/.aiter/jit
    (found without importing aiter; PyPI's unrelated ``aiter`` is told apart by its distribution)."""
    if os.environ.get("AITER_JIT_DIR"):
        return os.environ["AITER_JIT_DIR"]
    found = importlib.util.find_spec("aiter") if AITER.version() else None
    if found is not None and found.origin:
        package = os.path.join(os.path.dirname(found.origin), "jit")
        if os.access(package, os.W_OK):
            return package
    return os.path.join(os.path.expanduser("~"), ".aiter", "jit")


# Above kernelmux's triton backend (20) on ROCm: AMD's hand-tuned asm/CK kernels (unmeasured here).
_DEFAULTS = Defaults(
    priority=25,
    requirement=_ROCM,
    devices=frozenset({"cuda"}),  # ROCm tensors are torch "cuda" tensors
    jit=JitCache("AITER JIT (hipcc)", _jit_dir, "one module per op family"),
)

# The reasons the two declined quantizers give at startup (their entry modules cite the source).
QUANTIZE_FP8_REASON = (
    "aiter's fp8 quantizers (csrc/kernels/quant_kernels.cu data_to_per_row_scale, which per_group_quant_hip "
    "also runs on 1 x 128 rows) compute the scale as amax * (1 / fp8_max) and the codes as x * rcp(scale) "
    "(__builtin_amdgcn_rcpf), with no floor (an all-zero row or group gets scale 0): not the spec's IEEE "
    "divisions amax / fp8_max and x / scale nor its floors (1e-4 on a group's amax, 2^-126 on a scale), and "
    "the spec requires every code and scale bit for bit")
QUANTIZE_MXFP4_REASON = (
    "aiter's dynamic_mxfp4_quant (aiter/utility/fp4_utils.py, _dynamic_mxfp4_quant_kernel_asm_layout) rounds "
    "the block amax 'even' (amax + 2^21 ulps, masked) before floor(log2) - 2: a block whose amax has a mantissa "
    "in [1.75, 2) gets a scale one step above OCP's 'floor', and one in (1.5, 1.75) one step below 'ceil'")

_DRY = "dry-run only (no AMD GPU run yet): "

TABLE = (
    Entry("grouped_topk",
          _DRY + "biased_grouped_topk_hip (sigmoid + bias, 1 or 8 groups) and grouped_topk (softmax or sigmoid, "
          "1/2/4/8 groups), in-place outputs"),
    Entry("fused_moe",
          _DRY + "fused_moe on weights shuffled to (16, 16) per call: bf16/fp16 experts (QuantType.No) and "
          "128-block fp8 experts (per_128x128) in the platform's fp8; H and I % 128; an expert map as a mask"),
    Entry("paged_attention",
          _DRY + "flash_attn_varlen_func with the NHD block table (CK/asm paged split-KV): 16-bit caches, "
          "block_size % 128, causal/sliding window; pa_fwd_asm not used (5-D cache layout)"),
    Entry("mla_decode",
          _DRY + "mla_decode_fwd, non-persistent asm: bf16 q and cache, 576/512, page size 1 with per-token "
          "indices built from the block table per call; head counts and query lengths of hsa/<arch>/mla"),
    Entry("scaled_mm",
          _DRY + "gemm_a8w8_blockscale (1x128 x 128x128) and gemm_a8w8 (per-token x per-channel, per-tensor "
          "broadcast) in the platform's fp8, bf16/fp16 out, N and K % 128, no bias"),
    Entry("quantize_fp8",
          "declined: aiter's quantizers compute scale = amax * (1/max) and codes with rcp, not the spec's "
          "IEEE divisions",
          {"static_check": lambda platform: AITER.problem_for(CALLS["quantize_fp8"]) or QUANTIZE_FP8_REASON}),
    Entry("fp4_mm",
          _DRY + "gemm_a4w4 (gfx950): MXFP4 W4A4, bf16 out, N % 16, K % 64; B shuffled (16, 16) and both "
          "scales e8m0_shuffle'd per call",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.ROCM}), archs=frozenset({"gfx950"}))}),
    Entry("quantize_mxfp4",
          "declined: dynamic_mxfp4_quant rounds the shared scale 'even', neither the spec's 'floor' nor 'ceil'",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.ROCM}), archs=frozenset({"gfx950"})),
           "static_check": lambda platform: AITER.problem_for(CALLS["quantize_mxfp4"]) or QUANTIZE_MXFP4_REASON}),
    Gap("selective_state_update",
        "aiter (e4048607) has no Mamba2 selective-state kernel (only causal_conv1d_update and gated-delta-rule ops)"),
    Gap("ssd_scan",
        "aiter (e4048607) has no Mamba2 SSD kernel (only causal_conv1d and gated-delta-rule ops)"),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    # The installed version leads each description, so `kernelmux info` and the report name it.
    version = f"{AITER.distribution} {AITER.version() or '(not installed)'}: "
    table = [entry if isinstance(entry, Gap) else
             Entry(entry.op, version + entry.description,
                   {"static_check": AITER.static_check(CALLS[entry.op]), **entry.overrides})
             for entry in TABLE]
    return implementations(Backend.AITER, __name__, _DEFAULTS, table)
