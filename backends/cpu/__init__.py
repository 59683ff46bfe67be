"""The cpu backend: vectorized torch implementations for CPU tensors that beat the references
(speed-ups: `kernelmux bench --backend cpu`, recorded in perf/results/)."""

from __future__ import annotations

from kernelmux.specs import grouped_topk as grouped_topk_spec
from kernelmux.specs import mla_decode as mla_decode_spec
from kernelmux.specs import paged_attention as paged_attention_spec
from kernelmux.registry import Backend, Implementation, hookimpl


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.cpu import attention, grouped_topk

    def cpu(spec, fn, description: str) -> Implementation:
        return Implementation(
            op=spec.NAME,
            backend=Backend.CPU,
            fn=fn,
            spec_version=spec.SPEC.version,
            priority=10,
            devices=frozenset({"cpu"}),
            description=description,
        )

    return [
        cpu(grouped_topk_spec, grouped_topk.grouped_topk,
            "selection on logits, top-k over kept groups only, weights for chosen ids only"),
        cpu(paged_attention_spec, attention.paged_attention,
            "chunked block gather, GQA heads packed as rows, torch's fused CPU flash attention"),
        cpu(mla_decode_spec, attention.mla_decode,
            "chunked latent gather, all heads as rows of one problem, torch's fused CPU flash attention"),
    ]
