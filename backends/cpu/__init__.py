"""The cpu backend: vectorized torch implementations for CPU tensors that beat the references."""

from __future__ import annotations

from kernelmux.ops.specs import grouped_topk as grouped_topk_spec
from kernelmux.registry import Backend, Implementation, hookimpl


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.cpu import grouped_topk

    return [
        Implementation(
            op=grouped_topk_spec.NAME,
            backend=Backend.CPU,
            fn=grouped_topk.grouped_topk,
            spec_version=grouped_topk_spec.SPEC.version,
            priority=10,
            devices=frozenset({"cpu"}),
            description="selection on logits, top-k over kept groups only, weights for chosen ids only",
        )
    ]
