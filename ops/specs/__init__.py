"""One module per op spec; ALL_SPECS lists them in a stable order (the single source of op names)."""

from kernelmux.ops.specs import (
    grouped_topk,
    kv_cache_write,
    paged_attention,
    quantize_fp8,
    scaled_mm,
    selective_state_update,
    ssd_scan,
)

__all__ = ["ALL_SPECS"]

ALL_SPECS = (
    grouped_topk.SPEC,
    paged_attention.SPEC,
    kv_cache_write.SPEC,
    quantize_fp8.SPEC,
    scaled_mm.SPEC,
    ssd_scan.SPEC,
    selective_state_update.SPEC,
)
