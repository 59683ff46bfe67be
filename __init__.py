"""kernelmux: LLM-serving ops as specs, hardware backends as plugins, and an engine that picks.

Call ``kernelmux.ops.<op>(...)``; see ``kernelmux.report()`` for what was chosen and why.
"""

from kernelmux import errors
from kernelmux.engine import (
    Settings,
    configure,
    current,
    report,
    reset,
    resolve,
    warmup,
)
from kernelmux.platforms import Feature, Platform, PlatformKind, simulate
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl
from kernelmux import ops

__all__ = [
    "Backend",
    "Feature",
    "Implementation",
    "JitCache",
    "Platform",
    "PlatformKind",
    "PlatformRequirement",
    "Settings",
    "configure",
    "current",
    "errors",
    "hookimpl",
    "ops",
    "report",
    "reset",
    "resolve",
    "simulate",
    "warmup",
]
