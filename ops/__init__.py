"""The ops: ``kernelmux.ops.<name>(...)`` dispatches to the best implementation for the call.

Each op's spec lives in ``kernelmux.specs.<name>`` and is reachable as ``kernelmux.ops.<name>.spec``.
Every op is also the torch custom op ``torch.ops.kernelmux.<name>``.
"""

from kernelmux.ops._op import Op
from kernelmux.specs import ALL_SPECS

__all__ = [
    "ALL_OPS",
    "Op",
    "fp4_mm",
    "fused_moe",
    "grouped_topk",
    "int4_mm",
    "kv_cache_write",
    "mla_decode",
    "paged_attention",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "scaled_mm",
    "selective_state_update",
    "ssd_scan",
]

ALL_OPS = {spec.name: Op(spec) for spec in ALL_SPECS}

grouped_topk = ALL_OPS["grouped_topk"]
fused_moe = ALL_OPS["fused_moe"]
paged_attention = ALL_OPS["paged_attention"]
kv_cache_write = ALL_OPS["kv_cache_write"]
mla_decode = ALL_OPS["mla_decode"]
quantize_fp8 = ALL_OPS["quantize_fp8"]
scaled_mm = ALL_OPS["scaled_mm"]
quantize_nvfp4 = ALL_OPS["quantize_nvfp4"]
quantize_mxfp4 = ALL_OPS["quantize_mxfp4"]
fp4_mm = ALL_OPS["fp4_mm"]
ssd_scan = ALL_OPS["ssd_scan"]
selective_state_update = ALL_OPS["selective_state_update"]
int4_mm = ALL_OPS["int4_mm"]
