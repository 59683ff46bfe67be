"""The plugin registry: hook specs, the implementation record, and entry-point loading with quarantine."""

from kernelmux.registry._hookspecs import hookimpl, hookspec
from kernelmux.registry._implementation import (
    Backend,
    Implementation,
    JitCache,
    PlatformRequirement,
    StaticCheckFn,
    SupportsFn,
)
from kernelmux.registry._registry import (
    ENTRY_POINT_GROUP,
    PluginInfo,
    QuarantinedPlugin,
    RESERVED_NAMES,
    Registry,
    Rejection,
    builtin_module,
    signature_difference,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "Implementation",
    "JitCache",
    "PlatformRequirement",
    "PluginInfo",
    "QuarantinedPlugin",
    "RESERVED_NAMES",
    "Registry",
    "Rejection",
    "StaticCheckFn",
    "SupportsFn",
    "builtin_module",
    "hookimpl",
    "hookspec",
    "signature_difference",
]
