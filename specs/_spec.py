"""The spec framework: what an op *is* (OpSpec), its named input cases (Case), its cost and tolerance."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

import torch

__all__ = ["Case", "Cost", "OpSpec", "Tolerance", "drawn", "shapes_strategy"]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise closeness for floating outputs: |actual - expected| <= atol + rtol * |expected|."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class Cost:
    """The least work one call must do: floating-point operations and bytes moved through memory
    (each input read once, each output written once). The roofline divides these by ceilings."""

    flops: int
    bytes: int
    # Which dense matrix rate bounds the flops: "bf16" (fp16 alike), "fp8", "fp4" or "fp32". The
    # precision a conforming kernel may compute in, not the reference's (which is often fp32).
    matmul: str = "bf16"


@dataclass(frozen=True)
class Case:
    """A named input for tests and benchmarks.

    ``make(device, generator)`` returns the call's keyword arguments, drawn fresh from
    ``generator`` so every run checks new data. ``tags`` say what the case is for: ``model`` (a
    real model's shape), ``random`` (small, for tests), ``edge`` (a boundary), ``quick`` (small
    enough for ``--quick`` runs on a 2-core CPU), ``gpu`` (a model shape sized for an accelerator,
    e.g. a perf goal's: CPU runs of tests and benchmarks leave it out unless it is named). ``why``
    says why the shape is there.
    """

    name: str
    make: Callable[[torch.device, torch.Generator], dict[str, Any]]
    tags: frozenset[str]
    why: str

    def build(self, device: str | torch.device = "cpu", seed: int = 0) -> dict[str, Any]:
        """The case's keyword arguments on ``device``; drawn on the CPU so a seed means the same
        values on every device, then moved."""
        generator = torch.Generator().manual_seed(seed)
        kwargs = self.make(torch.device("cpu"), generator)
        device = torch.device(device)
        if device.type == "cpu":
            return kwargs
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def drawn(description: str, make: Callable[[torch.device, torch.Generator], dict[str, Any]]) -> Case:
    """A case an ``OpSpec.shapes`` strategy drew, named by what was drawn."""
    return Case(f"drawn: {description}", make, frozenset({"drawn"}), "drawn by hypothesis within the contract")


def shapes_strategy(draw_case: Callable[[Any, Any], Case]) -> Callable[[], Any]:
    """An ``OpSpec.shapes`` from ``draw_case(draw, st)``: the body of a hypothesis composite strategy,
    given hypothesis' draw function and its strategies module (imported only when shapes are asked for)."""
    def shapes() -> Any:
        from hypothesis import strategies as st

        return st.composite(lambda draw: draw_case(draw, st))()

    shapes.__doc__ = draw_case.__doc__
    return shapes


@dataclass(frozen=True, eq=False)
class OpSpec:
    """The contract of one op; the reference function *is* the contract.

    - ``reference``: pure-torch math (fp32 inside); its signature, with annotations and defaults,
      is the signature every implementation must have and the torch custom op's schema.
    - ``validate``: same signature; raises ``InvalidArgumentError`` naming the argument, or returns
      the *dispatch key*, an instance of ``key``. It runs on every call, so it must stay cheap:
      attribute reads, no tensor math, no device sync.
    - ``key``: the dispatch key's type, a NamedTuple of everything that can change which
      implementation accepts a call: the device (field ``device``, a ``torch.device``), dtypes,
      the dims that matter, host options, each tensor's ``Layout`` and the classes of sizes that
      vary per batch (specs/_key.py). Implementations decide from the key alone
      (``supports(key, platform)``) and the decision is cached per key, so a property missing
      from the key cannot be decided on.
    - ``check_data``, if given: same signature; checks the contents of the call's index tensors
      (block tables, slot mappings, offsets) against the shapes they index, with one device pass
      and one sync, raising ``DeviceDataError``. The engine runs it in checked mode only
      (``KERNELMUX_CHECK=1``): out-of-range indices are what kernels cannot survive.
    - ``fake``: same signature; returns outputs of the right shape, dtype and device without
      computing them (torch.compile and meta tensors).
    - ``check_close(actual, expected, kwargs)``: raises ``AssertionError`` with the worst
      coordinates when ``actual`` does not conform; knows the op's contract (e.g. order-free rows).
      ``actual`` and ``expected`` are what ``outputs`` returns for each run.
    - ``mutates_args``: the arguments an in-place op writes (declared to torch.library too).
    - ``canonical(outputs, kwargs)``, if given: the outputs rewritten so that results the
      contract treats as equal are equal element by element (top-k rows sorted by id), for error
      statistics such as the perf suite's; None when the outputs already are.
    - ``cost(kwargs)``: the op's ``Cost`` for the roofline.
    - ``shapes``, if given: ``shapes()`` returns a hypothesis strategy of small ``Case`` objects
      (tagged ``drawn``): shapes and options the contract allows, for the conformance kit to draw
      beyond the named cases (hypothesis is imported only when it is called).
    - ``version``: bumped whenever the semantics change; implementations state the version they
      implement and a mismatch is rejected at registration.
    """

    name: str
    version: int
    reference: Callable[..., Any]
    validate: Callable[..., Hashable]
    fake: Callable[..., Any]
    check_close: Callable[[Any, Any, Mapping[str, Any]], None]
    cost: Callable[[Mapping[str, Any]], Cost]
    cases: tuple[Case, ...]
    tolerance: Mapping[torch.dtype, Tolerance]
    key: type
    mutates_args: tuple[str, ...] = ()
    check_data: Callable[..., None] | None = None
    canonical: Callable[[Any, Mapping[str, Any]], Any] | None = None
    shapes: Callable[[], Any] | None = None
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        signature = inspect.signature(self.reference)
        if "device" not in getattr(self.key, "_fields", ()):
            raise TypeError(f"spec {self.name}: key must be a NamedTuple with a 'device' field, got {self.key!r}")
        for role in ("validate", "fake", "check_data"):
            if getattr(self, role) is None:
                continue
            other = inspect.signature(getattr(self, role))
            if list(other.parameters) != list(signature.parameters):
                raise TypeError(
                    f"spec {self.name}: {role} parameters {list(other.parameters)} differ from the "
                    f"reference's {list(signature.parameters)}"
                )
        names = [case.name for case in self.cases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"spec {self.name}: duplicate case names {duplicates}")
        object.__setattr__(self, "signature", signature)

    def outputs(self, result: Any, kwargs: Mapping[str, Any]) -> Any:
        """What a call produced, for comparison: its return value, or for an in-place op the
        return value (if any) followed by the mutated arguments."""
        if not self.mutates_args:
            return result
        mutated = tuple(kwargs[name] for name in self.mutates_args)
        return mutated if result is None else (result, *mutated)

    def case(self, name: str) -> Case:
        for case in self.cases:
            if case.name == name:
                return case
        raise KeyError(
            f"{self.name} has no case {name!r}; cases: {', '.join(c.name for c in self.cases)}"
        )

    def cases_tagged(self, tag: str) -> tuple[Case, ...]:
        return tuple(case for case in self.cases if tag in case.tags)

    def model_cases(self, quick: bool, device_type: str) -> list[Case]:
        """The cases the bench and ``kernelmux warmup`` run by default: the model cases (with
        ``quick``, those also tagged quick), less the gpu-tagged (GB-sized) ones on a CPU, which
        would take minutes per call there."""
        wanted = {"model", "quick"} if quick else {"model"}
        return [c for c in self.cases if wanted <= c.tags and not (device_type == "cpu" and "gpu" in c.tags)]
