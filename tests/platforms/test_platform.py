"""Platform detection through faked probes, and simulation by name."""

from __future__ import annotations

import types

import pytest
import torch

from kernelmux.platforms import Feature, PlatformKind, detect, simulate
from kernelmux.errors import PlatformError


def _probes(**overrides):
    base = dict(
        default_device=lambda: torch.device("cuda", 0),
        current_index=lambda device_type: 0,
        is_rocm=lambda: False,
        capability=lambda index: (9, 0),
        device_name=lambda device_type, index: f"fake {device_type} {index}",
        rocm_gcn_arch=lambda index: "gfx942",
        cpu_arch=lambda: "x86_64",
        cpu_flags=lambda: frozenset({"avx2", "avx512f", "amx_tile"}),
        cpu_name=lambda: "fake cpu",
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.fixture(autouse=True)
def _no_simulation(monkeypatch):
    monkeypatch.delenv("KERNELMUX_PLATFORM", raising=False)


def test_cuda_hopper_from_probes():
    platform = detect(probes=_probes())
    assert (platform.kind, platform.arch, platform.capability) == (PlatformKind.CUDA, "sm_90", (9, 0))
    assert {Feature.WGMMA, Feature.TMA, Feature.FP8} == platform.features
    assert platform.device_type == "cuda" and platform.fp8_flavour == "e4m3fn"
    assert not platform.simulated


def test_probe_takes_the_device_argument():
    seen = []
    probes = _probes(capability=lambda index: seen.append(index) or (10, 0))
    platform = detect(torch.device("cuda", 3), probes=probes)
    assert seen == [3] and platform.device_index == 3
    assert {Feature.TCGEN05, Feature.FP4_MMA} <= platform.features and Feature.WGMMA not in platform.features


def test_rocm_arch_and_fp8_flavour_from_the_device():
    platform = detect(probes=_probes(is_rocm=lambda: True, capability=lambda i: (9, 4)))
    assert (platform.kind, platform.arch, platform.fp8_flavour) == (PlatformKind.ROCM, "gfx942", "e4m3fnuz")
    assert platform.device_type == "cuda"  # torch names ROCm devices "cuda"
    gfx950 = detect(probes=_probes(is_rocm=lambda: True, rocm_gcn_arch=lambda i: "gfx950"))
    assert gfx950.fp8_flavour == "e4m3fn" and Feature.FP4_MMA in gfx950.features


def test_cpu_isa_features_from_flags():
    x86 = detect("cpu", probes=_probes())
    assert x86.kind is PlatformKind.CPU and {Feature.AVX512, Feature.AMX} <= x86.features
    arm = detect("cpu", probes=_probes(cpu_arch=lambda: "aarch64",
                                       cpu_flags=lambda: frozenset({"asimd", "asimddp", "i8mm", "sve"})))
    assert {Feature.NEON, Feature.SVE, Feature.KLEIDIAI} <= arm.features
    old_arm = detect("cpu", probes=_probes(cpu_arch=lambda: "aarch64", cpu_flags=lambda: frozenset({"asimd"})))
    assert Feature.KLEIDIAI not in old_arm.features
    z = detect("cpu", probes=_probes(cpu_arch=lambda: "s390x", cpu_flags=lambda: frozenset({"vxe"})))
    assert z.features == {Feature.VXE}


def test_real_probe_of_this_machine_describes_it():
    platform = detect()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert platform.device_type == expected and platform.arch


@pytest.mark.parametrize(
    "name, kind, arch, has, lacks",
    [
        ("sm_90", PlatformKind.CUDA, "sm_90", {Feature.WGMMA}, {Feature.TCGEN05}),
        ("sm_100", PlatformKind.CUDA, "sm_100", {Feature.TCGEN05, Feature.FP4_MMA}, {Feature.WGMMA}),
        ("sm_120", PlatformKind.CUDA, "sm_120", {Feature.FP4_MMA}, {Feature.TCGEN05}),
        ("gfx942", PlatformKind.ROCM, "gfx942", {Feature.FP8_FNUZ}, {Feature.FP4_MMA}),
        ("gfx950", PlatformKind.ROCM, "gfx950", {Feature.FP4_MMA}, {Feature.FP8_FNUZ}),
        ("aarch64", PlatformKind.CPU, "aarch64", {Feature.KLEIDIAI, Feature.SVE}, {Feature.AVX512}),
        ("s390x", PlatformKind.CPU, "s390x", {Feature.VXE}, {Feature.NEON}),
        ("x86_64+amx", PlatformKind.CPU, "x86_64", {Feature.AMX}, {Feature.SVE}),
        ("aarch64-sve-sve2", PlatformKind.CPU, "aarch64", {Feature.NEON}, {Feature.SVE, Feature.SVE2}),
        ("sm_90-fp8", PlatformKind.CUDA, "sm_90", {Feature.TMA}, {Feature.FP8}),
    ],
)
def test_simulate(name, kind, arch, has, lacks):
    platform = simulate(name)
    assert (platform.kind, platform.arch, platform.simulated) == (kind, arch, True)
    assert has <= platform.features and not (lacks & platform.features)


def test_detection_ignores_the_simulation_variable(monkeypatch):
    # Simulation is a setting the engine reads once (tests/engine); detection only asks the probes.
    monkeypatch.setenv("KERNELMUX_PLATFORM", "gfx950")
    assert detect("cpu", probes=_probes()).arch == "x86_64"


@pytest.mark.parametrize("name, fragment", [("sm90", "expected sm_XY"), ("gfx000", "known: gfx"),
                                            ("x86_64+warp", "cannot parse feature edits")])
def test_bad_simulation_names_are_explained(name, fragment):
    with pytest.raises(PlatformError, match=fragment):
        simulate(name)
