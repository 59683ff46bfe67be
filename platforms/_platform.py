"""The platform model: one description of CUDA, ROCm, XPU and CPU machines, detected or simulated."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kernelmux.errors import PlatformError
from kernelmux.platforms import probes as _probes

__all__ = [
    "Feature",
    "Platform",
    "PlatformKind",
    "detect",
    "simulate",
    "synchronize",
]

class PlatformKind(str, enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    CPU = "cpu"


class Feature(str, enum.Enum):
    """Hardware features an implementation may require."""

    # NVIDIA
    WGMMA = "wgmma"  # Hopper warpgroup MMA (sm_90)
    TMA = "tma"  # bulk tensor copy engine (sm_90+)
    TCGEN05 = "tcgen05"  # Blackwell datacenter tensor-core generation 5 (sm_100/sm_103)
    FP8 = "fp8"  # fp8 tensor-core math (sm_89+, gfx942+)
    FP4_MMA = "fp4-mma"  # native FP4 (NVFP4/MXFP4) MMA (sm_100+, sm_120, gfx950)
    # AMD
    FP8_FNUZ = "fp8-fnuz"  # the e4m3fnuz flavour (gfx942); others use OCP e4m3fn
    # CPUs
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512-bf16"
    AMX = "amx"
    NEON = "neon"
    DOTPROD = "dotprod"
    I8MM = "i8mm"
    SVE = "sve"
    SVE2 = "sve2"
    KLEIDIAI = "kleidiai"  # Arm CPU able to run KleidiAI's int4/int8 kernels (dotprod + i8mm)
    VXE = "vxe"  # s390x vector-enhancements facility


# Features that follow from a CUDA compute capability. One table, read both by detection and by
# simulation, so "what would run on sm_100" answers exactly what sm_100 hardware would.
_CUDA_FEATURES: dict[tuple[int, int], frozenset[Feature]] = {
    (8, 0): frozenset(),
    (8, 6): frozenset(),
    (8, 9): frozenset({Feature.FP8}),
    (9, 0): frozenset({Feature.WGMMA, Feature.TMA, Feature.FP8}),
    (10, 0): frozenset({Feature.TCGEN05, Feature.TMA, Feature.FP8, Feature.FP4_MMA}),
    (10, 3): frozenset({Feature.TCGEN05, Feature.TMA, Feature.FP8, Feature.FP4_MMA}),
    (12, 0): frozenset({Feature.TMA, Feature.FP8, Feature.FP4_MMA}),
    (12, 1): frozenset({Feature.TMA, Feature.FP8, Feature.FP4_MMA}),
}

_ROCM_FEATURES: dict[str, frozenset[Feature]] = {
    "gfx90a": frozenset(),
    "gfx942": frozenset({Feature.FP8, Feature.FP8_FNUZ}),
    "gfx950": frozenset({Feature.FP8, Feature.FP4_MMA}),
    "gfx1100": frozenset(),
    "gfx1201": frozenset({Feature.FP8}),
}

# CPU ISA flags as /proc/cpuinfo spells them, mapped to features.
_CPU_FLAG_FEATURES: dict[str, Feature] = {
    "avx2": Feature.AVX2,
    "avx512f": Feature.AVX512,
    "avx512_bf16": Feature.AVX512_BF16,
    "amx_tile": Feature.AMX,
    "asimd": Feature.NEON,
    "asimddp": Feature.DOTPROD,
    "i8mm": Feature.I8MM,
    "sve": Feature.SVE,
    "sve2": Feature.SVE2,
    "vxe": Feature.VXE,
}

# What a simulated CPU of each architecture is assumed to have: a current server part.
_SIMULATED_CPU_FEATURES: dict[str, frozenset[Feature]] = {
    "x86_64": frozenset({Feature.AVX2, Feature.AVX512, Feature.AVX512_BF16}),
    "aarch64": frozenset(
        {Feature.NEON, Feature.DOTPROD, Feature.I8MM, Feature.SVE, Feature.SVE2, Feature.KLEIDIAI}
    ),
    "s390x": frozenset({Feature.VXE}),
}


@dataclass(frozen=True)
class Platform:
    """What the engine selects for: vendor kind, architecture, capability and features."""

    kind: PlatformKind
    arch: str  # sm_90, sm_100, gfx942, x86_64, aarch64, s390x, xpu
    capability: tuple[int, int] | None = None  # CUDA compute capability / ROCm gfx major.minor
    features: frozenset[Feature] = field(default_factory=frozenset)
    device_name: str = ""
    device_index: int | None = None
    simulated: bool = False

    @property
    def device_type(self) -> str:
        """The torch device type of tensors on this platform (ROCm tensors are ``cuda`` in torch)."""
        return "cpu" if self.kind is PlatformKind.CPU else (
            "xpu" if self.kind is PlatformKind.XPU else "cuda"
        )

    @property
    def device(self) -> torch.device:
        """The torch device this platform describes (the first of its kind when simulated)."""
        if self.kind is PlatformKind.CPU:
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_index or 0)

    @property
    def fp8_flavour(self) -> str | None:
        if Feature.FP8 not in self.features:
            return None
        return "e4m3fnuz" if Feature.FP8_FNUZ in self.features else "e4m3fn"

    def has(self, feature: Feature) -> bool:
        return feature in self.features

    def describe(self) -> str:
        parts = [f"{self.kind.value} {self.arch}"]
        if self.device_name:
            parts.append(f"({self.device_name})")
        if self.simulated:
            parts.append("[simulated]")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "arch": self.arch,
            "capability": list(self.capability) if self.capability else None,
            "features": sorted(f.value for f in self.features),
            "fp8_flavour": self.fp8_flavour,
            "device_name": self.device_name,
            "device_index": self.device_index,
            "simulated": self.simulated,
        }


def _cuda_features(capability: tuple[int, int]) -> frozenset[Feature]:
    if capability in _CUDA_FEATURES:
        return _CUDA_FEATURES[capability]
    # An unlisted capability inherits from the nearest listed one of the same major below it.
    same_major = [c for c in _CUDA_FEATURES if c[0] == capability[0] and c <= capability]
    return _CUDA_FEATURES[max(same_major)] if same_major else frozenset()


def _cpu_features(arch: str, flags: Iterable[str]) -> frozenset[Feature]:
    features = {_CPU_FLAG_FEATURES[f] for f in flags if f in _CPU_FLAG_FEATURES}
    if arch == "aarch64" and {Feature.DOTPROD, Feature.I8MM} <= features:
        features.add(Feature.KLEIDIAI)
    return frozenset(features)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on a CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "xpu":
        torch.xpu.synchronize(device)


def detect(device: torch.device | str | int | None = None, probes: Any = None) -> Platform:
    """Describe the platform of ``device`` (default: the first accelerator, else the CPU).

    ``probes`` replaces the hardware probes (tests pass a fake). Simulation (``KERNELMUX_PLATFORM``)
    is the engine's: it reads the setting once and calls :func:`simulate` instead.
    """
    probes = probes or _probes
    if device is None:
        device = probes.default_device()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cuda":
        index = device.index if device.index is not None else probes.current_index(device.type)
        name = probes.device_name(device.type, index)
        if probes.is_rocm():
            arch = probes.rocm_gcn_arch(index)
            return Platform(
                PlatformKind.ROCM, arch, probes.capability(index),
                _ROCM_FEATURES.get(arch, frozenset()), name, index,
            )
        capability = probes.capability(index)
        return Platform(
            PlatformKind.CUDA, f"sm_{capability[0]}{capability[1]}", capability,
            _cuda_features(capability), name, index,
        )
    if device.type == "xpu":
        index = device.index if device.index is not None else probes.current_index(device.type)
        return Platform(PlatformKind.XPU, "xpu", None, frozenset(), probes.device_name("xpu", index), index)
    if device.type == "cpu":
        arch = probes.cpu_arch()
        return Platform(
            PlatformKind.CPU, arch, None, _cpu_features(arch, probes.cpu_flags()), probes.cpu_name()
        )
    raise PlatformError(f"cannot describe device type {device.type!r}; known: cuda, xpu, cpu")


# Feature names contain '-', so edits match known names, longest first, not a character class.
_FEATURE_EDIT = re.compile(
    r"([+-])(" + "|".join(sorted((re.escape(f.value) for f in Feature), key=len, reverse=True)) + ")"
)


def simulate(description: str) -> Platform:
    """A platform from a name, for asking what would run there: ``sm_90``, ``sm_100``, ``sm_120``,
    ``gfx942``, ``gfx950``, ``x86_64``, ``aarch64``, ``s390x``, ``xpu``; features can be added or
    removed with ``+name`` / ``-name`` suffixes (``x86_64+amx``, ``aarch64-sve``)."""
    text = description.strip().lower()
    match = re.match(r"^(sm_[0-9]+|gfx[0-9a-f]+|x86_64|aarch64|arm64|s390x|xpu)(.*)$", text)
    if not match:
        raise PlatformError(
            f"cannot simulate platform {description!r}; expected sm_XY (e.g. sm_90, sm_100), "
            "gfxNNN (gfx942, gfx950), x86_64, aarch64, s390x or xpu, optionally with +feature/-feature"
        )
    base, edits = match.group(1), match.group(2)
    if base.startswith("sm_"):
        digits = base[3:]
        # sm_<major><minor>: a one-digit minor after a major of one or two digits (sm_90 is 9.0,
        # sm_120 is 12.0); "sm_9" has no minor and "sm_090" a leading zero.
        if not 2 <= len(digits) <= 3 or digits[0] == "0":
            known = ", ".join(f"sm_{major}{minor}" for major, minor in sorted(_CUDA_FEATURES))
            raise PlatformError(
                f"cannot simulate platform {description!r}: {base!r} is not a CUDA arch; expected "
                f"sm_<major><minor> with a one-digit minor, e.g. sm_90 for compute capability 9.0 "
                f"(listed: {known})"
            )
        capability = (int(digits[:-1]), int(digits[-1]))
        platform = Platform(PlatformKind.CUDA, base, capability, _cuda_features(capability),
                            f"simulated {base}", 0, True)
    elif base.startswith("gfx"):
        if base not in _ROCM_FEATURES:
            raise PlatformError(
                f"cannot simulate ROCm arch {base!r}; known: {', '.join(sorted(_ROCM_FEATURES))}"
            )
        major = int(base[3:-2]) if len(base) > 5 else int(base[3])
        platform = Platform(PlatformKind.ROCM, base, (major, int(base[-2], 16)),
                            _ROCM_FEATURES[base], f"simulated {base}", 0, True)
    elif base == "xpu":
        platform = Platform(PlatformKind.XPU, "xpu", None, frozenset(), "simulated xpu", 0, True)
    else:
        arch = "aarch64" if base == "arm64" else base
        platform = Platform(PlatformKind.CPU, arch, None, _SIMULATED_CPU_FEATURES[arch],
                            f"simulated {arch}", None, True)
    features = set(platform.features)
    consumed = "".join(m.group(0) for m in _FEATURE_EDIT.finditer(edits))
    if consumed != edits:
        raise PlatformError(
            f"cannot parse feature edits {edits!r} in {description!r}; write +name or -name with "
            f"names from: {', '.join(f.value for f in Feature)}"
        )
    for sign, name in _FEATURE_EDIT.findall(edits):
        feature = Feature(name)
        (features.add if sign == "+" else features.discard)(feature)
    return Platform(platform.kind, platform.arch, platform.capability, frozenset(features),
                    platform.device_name, platform.device_index, True)
