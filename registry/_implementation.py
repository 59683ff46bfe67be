"""The implementation record: one op's implementation by one backend, as frozen, validated data."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from kernelmux.platforms import Feature, Platform, PlatformKind

__all__ = ["Backend", "Implementation", "JitCache", "PlatformRequirement", "StaticCheckFn", "SupportsFn"]

# supports(key, platform): the spec's dispatch key and the platform of the call's device.
SupportsFn = Callable[[Any, "Platform"], Optional[str]]
# static_check(platform): once per platform, not per call.
StaticCheckFn = Callable[["Platform"], Optional[str]]


class Backend(str, enum.Enum):
    """Names of the built-in backends (plugins may use any other name)."""

    REFERENCE = "reference"
    CPU = "cpu"
    TRITON = "triton"
    CUDA = "cuda"
    FLASHINFER = "flashinfer"
    DEEPGEMM = "deepgemm"
    TORCH = "torch"
    AITER = "aiter"  # AMD's AITER on ROCm
    XPU = "xpu"


@dataclass(frozen=True)
class JitCache:
    """Where an implementation's first call per variant compiles to: Triton's JIT, NVRTC, a vendor's
    nvcc JIT. ``directory()`` is resolved when asked (environment variables move these caches);
    ``variant`` says what compiles once (a kernel per dtype and constexpr set, a module per shape).
    ``kernelmux warmup`` runs those first calls ahead of time; ``kernelmux info`` lists the caches."""

    name: str
    directory: Callable[[], str]
    variant: str = ""

    def describe(self) -> str:
        return f"{self.name}, {self.variant}, cached in {self.directory()}" if self.variant else \
            f"{self.name}, cached in {self.directory()}"


@dataclass(frozen=True)
class PlatformRequirement:
    """Static conditions on the platform; empty fields mean "any"."""

    kinds: frozenset["PlatformKind"] = frozenset()
    archs: frozenset[str] = frozenset()
    min_capability: tuple[int, int] | None = None
    features: frozenset["Feature"] = frozenset()

    def check(self, platform: "Platform") -> str | None:
        """None when ``platform`` meets the requirement, else why not."""
        if self.kinds and platform.kind not in self.kinds:
            wanted = ", ".join(sorted(k.value for k in self.kinds))
            return f"needs a {wanted} platform, this is {platform.kind.value}"
        if self.archs and platform.arch not in self.archs:
            return f"needs arch in {{{', '.join(sorted(self.archs))}}}, this is {platform.arch}"
        if self.min_capability is not None and (
            platform.capability is None or platform.capability < self.min_capability
        ):
            have = ".".join(map(str, platform.capability)) if platform.capability else "none"
            return f"needs capability >= {'.'.join(map(str, self.min_capability))}, this has {have}"
        missing = self.features - platform.features
        if missing:
            return f"needs features {', '.join(sorted(f.value for f in missing))} ({platform.arch} lacks them)"
        return None

    def describe(self) -> str:
        parts = []
        if self.kinds:
            parts.append("/".join(sorted(k.value for k in self.kinds)))
        if self.archs:
            parts.append("arch in " + ",".join(sorted(self.archs)))
        if self.min_capability:
            parts.append("capability >= " + ".".join(map(str, self.min_capability)))
        if self.features:
            parts.append("+".join(sorted(f.value for f in self.features)))
        return " ".join(parts) or "any platform"


@dataclass(frozen=True)
class Implementation:
    """One op's implementation by one backend.

    - ``fn`` must have exactly the spec's signature (checked at registration).
    - ``supports``, if given, is called as ``supports(key, platform)`` with the call's dispatch
      key (an instance of the spec's ``key`` NamedTuple, e.g. ``paged_attention.Key``: dtypes,
      dims, options, each tensor's layout, size classes) and the ``Platform`` of the device the
      call's tensors are on, and returns None when it accepts the call or a human reason when
      it does not. It sees nothing else, so its answer, cached per key, holds for every call
      with that key.
    - ``requirement``: static conditions on the platform, checked at startup (and for a call on
      a device whose platform differs from the startup one).
    - ``static_check``, if given: ``static_check(platform)`` returns None or why the
      implementation cannot run on this machine beyond its requirement (a runtime library not
      found); asked once per platform, like ``requirement``.
    - ``devices``: torch device types of the inputs it runs on (empty: any).
    - ``packages``: import names it needs; a missing one rejects it with a pip hint.
    - ``priority``: higher runs first among viable implementations, after user preferences.
    - ``jit``: where its first call per variant compiles to (``JitCache``), or None.
    - ``capture_check``, if given: ``capture_check(key, platform)`` returns None when a call with that
      key can be captured in a CUDA graph, else why not (a host-side plan per call). Under capture the
      engine runs the next candidate that accepts the call and can be captured instead.
    - ``describe``, if given: ``describe(key, platform)`` says what a call with that key runs (a
      launch configuration, and whether it was measured or guessed), for ``kernelmux explain``.
    """

    op: str
    backend: str
    fn: Callable[..., Any]
    spec_version: int
    priority: int = 0
    requirement: PlatformRequirement = PlatformRequirement()
    devices: frozenset[str] = frozenset()
    packages: tuple[str, ...] = ()
    supports: SupportsFn | None = None
    static_check: StaticCheckFn | None = None
    description: str = ""
    jit: JitCache | None = None  # None: nothing compiles at the first call
    capture_check: SupportsFn | None = None  # None: every call it accepts can be captured
    describe: Callable[[Any, Any], str] | None = None  # None: explain says nothing beyond accepting
    plugin: str = field(default="", compare=False)  # filled in by the registry

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.op, str) or not self.op:
            problems.append(f"op must be a non-empty str, got {self.op!r}")
        if not isinstance(self.backend, str) or not self.backend:
            problems.append(f"backend must be a non-empty str, got {self.backend!r}")
        if not callable(self.fn):
            problems.append(f"fn must be callable, got {type(self.fn).__name__}")
        for role in ("supports", "static_check", "capture_check", "describe"):
            value = getattr(self, role)
            if value is not None and not callable(value):
                problems.append(f"{role} must be callable or None, got {type(value).__name__}")
        if type(self.spec_version) is not int:
            problems.append(f"spec_version must be an int, got {self.spec_version!r}")
        if type(self.priority) is not int:
            problems.append(f"priority must be an int, got {self.priority!r}")
        if self.jit is not None and not isinstance(self.jit, JitCache):
            problems.append(f"jit must be a JitCache or None, got {type(self.jit).__name__}")
        if problems:
            raise TypeError("invalid Implementation: " + "; ".join(problems))
        if isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", self.backend.value)
        object.__setattr__(self, "devices", frozenset(self.devices))
        object.__setattr__(self, "packages", tuple(self.packages))

    @property
    def key(self) -> str:
        return f"{self.op}:{self.backend}"

    def missing_packages(self) -> tuple[str, ...]:
        return tuple(p for p in self.packages if importlib.util.find_spec(p) is None)

    def platform_problem(self, platform: "Platform") -> str | None:
        """Why this implementation cannot run on ``platform`` (its requirement, then its static
        check), or None."""
        reason = self.requirement.check(platform)
        if reason is None and self.static_check is not None:
            reason = self.static_check(platform)
        return reason
