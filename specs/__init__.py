"""The specs: the framework (``OpSpec``, ``Case``, ``Cost``, ``Tolerance``, the call ``Key``) and one
module per op (signature, reference, validation, fake, cases, cost). ALL_SPECS lists them in a stable
order: the single source of op names."""

from kernelmux.specs._spec import Case, Cost, OpSpec, Tolerance
from kernelmux.specs import (
    fp4_mm,
    fused_moe,
    grouped_topk,
    int4_mm,
    kv_cache_write,
    mla_decode,
    paged_attention,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    scaled_mm,
    selective_state_update,
    ssd_scan,
)

__all__ = ["ALL_SPECS", "Case", "Cost", "OpSpec", "Tolerance"]

ALL_SPECS = (
    grouped_topk.SPEC,
    fused_moe.SPEC,
    paged_attention.SPEC,
    kv_cache_write.SPEC,
    mla_decode.SPEC,
    quantize_fp8.SPEC,
    scaled_mm.SPEC,
    quantize_nvfp4.SPEC,
    quantize_mxfp4.SPEC,
    fp4_mm.SPEC,
    ssd_scan.SPEC,
    selective_state_update.SPEC,
    int4_mm.SPEC,
)
