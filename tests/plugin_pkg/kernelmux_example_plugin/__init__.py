"""A test plugin, not a real backend: registers grouped_topk for backend ``example`` by calling
the spec's reference and counting its calls, so tests can see when the engine dispatched to it."""

from typing import Optional

import torch

from kernelmux import Implementation, Platform, hookimpl
from kernelmux.specs import grouped_topk as grouped_topk_spec

# No `from __future__ import annotations`: the signature must equal the spec reference's, and the
# registry compares annotations as objects.

CALLS = 0  # how many times grouped_topk below has run in this process


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count the call, then compute it with the spec's reference."""
    global CALLS
    CALLS += 1
    return grouped_topk_spec.SPEC.reference(
        gating_output,
        topk,
        renormalize,
        num_expert_group,
        topk_group,
        scoring_func,
        routed_scaling_factor,
        e_score_correction_bias,
    )


def supports(key: grouped_topk_spec.Key, platform: Platform) -> Optional[str]:
    """Decline all but fp32 logits (an arbitrary limit, so tests see a decline). Like every
    supports(), it decides from the call's dispatch key (the spec's Key: dtypes, dims, options,
    layouts) and the platform alone, so its answer holds for every call with that key."""
    if key.logits_dtype != torch.float32:
        return f"example plugin takes fp32 logits only, got {key.logits_dtype}"
    return None


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return [
        Implementation(
            op=grouped_topk_spec.NAME,
            backend="example",
            fn=grouped_topk,
            supports=supports,
            spec_version=grouped_topk_spec.SPEC.version,
            priority=5,  # below the built-in cpu backend (10), above the reference (-1000)
            devices=frozenset({"cpu"}),
            description="test plugin: the spec's reference, with a call counter",
        )
    ]
