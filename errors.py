"""Typed errors of kernelmux: every failure a caller can see is one of these, carrying its subject."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "ConfigurationError",
    "DeviceDataError",
    "ImplementationError",
    "InvalidArgumentError",
    "KernelmuxError",
    "NoImplementationError",
    "PlatformError",
    "PluginConflictError",
    "PluginLoadError",
    "RegistrationError",
    "UnknownOpError",
]


class KernelmuxError(Exception):
    """Base of every kernelmux error."""


class InvalidArgumentError(KernelmuxError, ValueError):
    """A call's argument does not meet the op's spec.

    Carries the op, the argument's name, what was expected and what was given, so callers can
    react programmatically and the message can say all of it.
    """

    def __init__(self, op: str, argument: str, expected: str, actual: Any, hint: str = "") -> None:
        self.op = op
        self.argument = argument
        self.expected = expected
        self.actual = actual
        message = f"{op}: argument '{argument}': expected {expected}, got {actual}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


class UnknownOpError(KernelmuxError, KeyError):
    """An op name that no spec defines."""

    def __init__(self, op: str, known: Sequence[str]) -> None:
        self.op = op
        self.known = tuple(known)
        super().__init__(f"unknown op {op!r}; known ops: {', '.join(sorted(known)) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class RegistrationError(KernelmuxError):
    """An implementation was rejected at registration (signature, duplicate, version, bad record)."""

    def __init__(self, plugin: str, op: str, backend: str, problem: str) -> None:
        self.plugin = plugin
        self.op = op
        self.backend = backend
        self.problem = problem
        super().__init__(f"plugin {plugin!r}: implementation {op}:{backend} rejected: {problem}")


class PluginLoadError(KernelmuxError):
    """A plugin failed to import or to register; raised only in strict mode (else quarantined)."""

    def __init__(self, plugin: str, distribution: str, problem: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.problem = problem
        super().__init__(f"plugin {plugin!r} (from {distribution}) failed to load: {problem}")


class PluginConflictError(PluginLoadError):
    """A plugin not loaded because its name is reserved for a built-in backend or declared by
    another distribution too; raised only in strict mode (else quarantined)."""

    def __init__(self, plugin: str, distribution: str, problem: str) -> None:
        super().__init__(plugin, distribution, problem)
        # Same carried fields as PluginLoadError, a message that does not claim an import failed.
        self.args = (f"plugin {plugin!r} (from {distribution}) was not loaded: {problem}",)


class PlatformError(KernelmuxError, ValueError):
    """A platform description that cannot be parsed or simulated."""


class NoImplementationError(KernelmuxError, RuntimeError):
    """Strict mode: no candidate accepted a call. Lists every candidate and why it declined."""

    def __init__(self, op: str, reasons: Sequence[tuple[str, str]]) -> None:
        self.op = op
        self.reasons = tuple(reasons)
        lines = "\n".join(f"  - {backend}: {reason}" for backend, reason in self.reasons)
        super().__init__(
            f"{op}: no implementation accepted this call and strict mode forbids the reference "
            f"fallback; candidates:\n{lines or '  (none registered for this platform)'}"
        )


class DeviceDataError(InvalidArgumentError):
    """Checked mode: an index tensor's contents (a block table, a slot mapping, sequence offsets)
    point outside what they index. Raised before any implementation runs."""


class ImplementationError(KernelmuxError, RuntimeError):
    """An implementation failed a call: it raised (the original is the ``__cause__``) or, in
    checked mode, returned outputs whose structure, shape, dtype or device break the spec.
    Names the op, the backend and the plugin (with its distribution) that provided it."""

    def __init__(self, op: str, backend: str, plugin: str, distribution: str, problem: str) -> None:
        self.op = op
        self.backend = backend
        self.plugin = plugin
        self.distribution = distribution
        self.problem = problem
        source = f"plugin {plugin!r}" + (f" from {distribution}" if distribution else "")
        super().__init__(f"{op}: implementation {op}:{backend} ({source}) {problem}")


class ConfigurationError(KernelmuxError, ValueError):
    """A setting (environment variable or ``configure`` argument) names something that does not
    exist or cannot be parsed; the message lists what is known."""
