"""The cpu backend: vectorized torch implementations for CPU tensors that beat the references
(speed-ups: `kernelmux bench --backend cpu`)."""

from __future__ import annotations

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.registry import Backend, Implementation, hookimpl

_DEFAULTS = Defaults(priority=10, devices=frozenset({"cpu"}))

TABLE = (
    Entry("grouped_topk",
          "selection on logits, top-k over kept groups only, weights for chosen ids only"),
    Entry("paged_attention",
          "chunked block gather, GQA heads packed as rows, torch's fused CPU flash attention"),
    Entry("mla_decode",
          "chunked latent gather, all heads as rows of one problem, torch's fused CPU flash attention"),
    Entry("quantize_fp8",
          "blocks of rows widened to fp32 once, scales broadcast over their groups, torch's cast into the output"),
    Entry("scaled_mm",
          "weights dequantized a block of rows at a time through the fp8 -> fp16 bit route, scales broadcast, "
          "fp32 GEMM"),
    Entry("quantize_nvfp4",
          "the reference's arithmetic bit for bit in fewer passes: one block-maximum pass gives the global amax, "
          "codes by integer passes on fp32 bits (a search for few values)"),
    Entry("quantize_mxfp4",
          "one block-maximum pass that also marks NaN / Inf blocks, divisors from a table by code, codes by integer "
          "passes on fp32 bits (a search for few values)"),
    Entry("fp4_mm",
          "W4A16 and W4A4, both formats: weights decoded a chunk of rows at a time (byte -> value-pair table, "
          "scales by code) into fp32 GEMMs"),
    Entry("selective_state_update",
          "a request at a time, its state slot decayed, rank-1 updated and read out in place (three passes)"),
    Entry("ssd_scan",
          "the reference's chunks with fp64 decay sums, each Q x Q matrix written once and scaled in place, C.B "
          "per group; small chunks batched"),
    Entry("fused_moe",
          "pairs grouped per expert; bf16/fp16 GEMM in place for few rows, else weights (fp8, fp4 decoded) to fp32 in chunks"),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return implementations(Backend.CPU, __name__, _DEFAULTS, TABLE)
