"""The platform vocabulary every layer speaks: ``Platform`` (kind, arch, capability, features),
its detection through the hardware probes (``probes``), and simulation for "what would run on X?"."""

from kernelmux.platforms import probes
from kernelmux.platforms._platform import Feature, Platform, PlatformKind, detect, simulate, synchronize

__all__ = ["Feature", "Platform", "PlatformKind", "detect", "probes", "simulate", "synchronize"]
