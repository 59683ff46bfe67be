"""Counting fake implementations and plugins for registry and engine tests, ``ask``: a supports()
function's answer to a call, as the engine would get it, and ``check_against_reference``: a backend's
call checked against its spec's reference on NaN-poisoned memory."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from conftest import DEVICE
from kernelmux.conformance import poison_freed_memory
from kernelmux.platforms import Platform, detect
from kernelmux.specs.grouped_topk import SPEC
from kernelmux.registry import Implementation, PlatformRequirement, hookimpl


def ask(supports: Callable, spec, kwargs: dict, platform: Optional[Platform] = None) -> Optional[str]:
    """``supports``' answer to a call of ``spec``'s op with ``kwargs``: the dispatch key the
    spec's validate builds, and ``platform`` (default: the platform of the key's device)."""
    key = spec.validate(**kwargs)
    return supports(key, platform if platform is not None else detect(key.device))


class Counter:
    """Counts calls of a fake implementation and of its supports()."""

    def __init__(self) -> None:
        self.calls = 0
        self.supports_calls = 0


def check_against_reference(spec: Any, fn: Callable[..., torch.Tensor], kwargs: dict, what: str,
                            poison_bytes: int) -> torch.Tensor:
    """``fn(**kwargs)`` on an allocator poisoned with ``poison_bytes`` of NaNs, checked against ``spec``'s
    reference; a mismatch names the case (``what``). Returns fn's output."""
    expected = spec.reference(**kwargs)
    poison_freed_memory(DEVICE, poison_bytes)
    actual = fn(**kwargs)
    try:
        spec.check_close(actual, expected, kwargs)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
    return actual


def counting_grouped_topk(counter: Counter) -> Callable:
    """A grouped_topk with the spec's exact signature that counts calls and returns the reference."""

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
        counter.calls += 1
        return SPEC.reference(gating_output, topk, renormalize, num_expert_group, topk_group,
                              scoring_func, routed_scaling_factor, e_score_correction_bias)

    return grouped_topk


def fake_impl(
    backend: str,
    counter: Counter,
    *,
    priority: int = 0,
    decline: Callable[[Any], Optional[str]] | None = None,  # given the dispatch key
    devices: frozenset[str] = frozenset(),
    requirement: PlatformRequirement = PlatformRequirement(),
    spec_version: int = SPEC.version,
) -> Implementation:
    supports = None
    if decline is not None:
        def supports(key, platform):
            counter.supports_calls += 1
            return decline(key)

    return Implementation(
        op=SPEC.name, backend=backend, fn=counting_grouped_topk(counter), spec_version=spec_version,
        priority=priority, supports=supports, devices=devices, requirement=requirement,
    )


class FakePlugin:
    """A plugin object whose hook returns the given records."""

    def __init__(self, *impls: Implementation) -> None:
        self.impls = list(impls)

    @hookimpl
    def kernelmux_implementations(self):
        return self.impls


class RaisingPlugin:
    @hookimpl
    def kernelmux_implementations(self):
        raise RuntimeError("backend library failed to initialize")
