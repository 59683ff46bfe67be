"""The cuda kernels' named ABI (backends/cuda/_params.py): each kernel's parameters are its params
struct's fields, which are its ctypes mirror's; a mirror that disagrees fails the compilation,
naming the struct, and the cubin's parameters are the mirror's fields, size for size (the launch
points the driver at each field). NVRTC compiles for sm_90 without a GPU."""

from __future__ import annotations

import ctypes
import pathlib
import re
import subprocess
import tempfile

import pytest

from cuda_kernels import CUOBJDUMP, needs_cuobjdump, needs_nvrtc
from kernelmux.backends.cuda import (_compile, _driver, _paged_decode, _paged_prefill, _params, _quantize_fp4,
                                    _toolchain, fp4_mm, fused_moe, mla_decode, quantize_fp8, scaled_mm)

pytestmark = needs_nvrtc

DECODE = "paged_decode_fp8<1, true, 4, false, true, false, 16>"


def _variant(mirror: type[ctypes.Structure], fields: list) -> type[ctypes.Structure]:
    """A mirror of the same name (the struct the checks name) with other fields."""
    return type(mirror.__name__, (ctypes.Structure,), {"_fields_": fields})


def _compile_checked(mirror: type[ctypes.Structure]) -> None:
    source = (_toolchain.KERNELS / _paged_decode.SOURCE_NAME).read_text() + _params.abi_checks(mirror, [DECODE])
    _compile.compile_module(source, [DECODE], (9, 0))


def test_the_mirrors_compile_against_their_kernels():
    _compile_checked(_params.PagedDecodeParams)


@pytest.mark.parametrize("change, message", [
    # A field the kernel takes is missing from the mirror: the size and the parameter list differ.
    ("removed", r"PagedDecodeParams: its size differs from its host mirror's \(224 bytes"),
    ("removed", r"paged_decode_fp8<1, true, 4, false, true, false, 16>: its parameters are not the fields of "
                r"PagedDecodeParams, in order"),
    # A field of another kind (an int the kernel reads as a float) at the same place.
    ("retyped", r"PagedDecodeParams.window: the host mirror \(backends/cuda/_params.py\) has a float32 here"),
    # A field the struct does not have.
    ("renamed", r"PagedDecodeParams.*has no member \"windows\"|class \"PagedDecodeParams\" has no member"),
])
def test_a_mirror_that_disagrees_fails_the_compilation_naming_the_struct(change, message):
    fields = list(_params.PagedDecodeParams._fields_)
    if change == "removed":
        fields = [f for f in fields if f[0] != "window"]
    elif change == "retyped":
        fields = [(name, ctypes.c_float if name == "window" else kind) for name, kind in fields]
    else:
        fields = [("windows" if name == "window" else name, kind) for name, kind in fields]
    with pytest.raises(_toolchain.NvrtcError, match=message):
        _compile_checked(_variant(_params.PagedDecodeParams, fields))


def _kernel_params(cubin: bytes, lowered: str) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of the cubin's kernel ``lowered`` (its mangled name), in
    order: the EIATTR_KPARAM_INFO records of its ELF section .nv.info.<name>."""
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "module.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([CUOBJDUMP, "-elf", str(path)], check=True, capture_output=True, text=True).stdout
    section = listing.split(f"\n.nv.info.{lowered}\n", 1)[1].split("\n.", 1)[0]
    found = re.findall(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*(0x[0-9a-f]+)\s+Size\s*:\s*(0x[0-9a-f]+)", section)
    return [(int(offset, 16), int(size, 16)) for _, offset, size in sorted(found, key=lambda f: int(f[0], 16))]


def _alone(filename: str, mirror):
    """A source function: kernels/``filename`` with the named ABI's checks of ``mirror`` alone."""
    return lambda names: _params.checked_source(filename, [(mirror, names)])


@needs_cuobjdump
@pytest.mark.parametrize("mirror, source, name, arch_specific", [
    (_params.PagedDecodeParams, _paged_decode.source, DECODE, False),
    (_params.MergeSplitsParams, _paged_decode.source, "merge_splits<128, 2, true>", False),
    (_params.PagedPrefillParams, _paged_prefill.source, "paged_prefill_sm90<true, false, 3, true, false>", True),
    (_params.MlaDecodeParams, lambda names: mla_decode.source(names, []), "mla_decode_sm90<true, true>", True),
    (_params.MergeSplitsParams, lambda names: mla_decode.source([], names), "merge_splits<512, 1, true>", True),
    (_params.MergeSplitsParams, lambda names: mla_decode.source([], names), "merge_splits<512, 2, true>", True),
    # A TMA map, then the rest.
    (_params.MoeGemmParams, _alone(fused_moe.SOURCE_NAME, _params.MoeGemmParams),
     "moe_gemm_sm90<true, true, false, 4, true>", True),
    (_params.MoeDecodeGateUpParams, _alone(fused_moe.DECODE_SOURCE_NAME, _params.MoeDecodeGateUpParams),
     "moe_decode_gate_up<true, false>", False),
    (_params.MoeDecodeDownParams, _alone(fused_moe.DECODE_SOURCE_NAME, _params.MoeDecodeDownParams),
     "moe_decode_down<false>", False),
    (_params.MoeDecodeFp4GateUpParams, _alone(fused_moe.DECODE_SOURCE_NAME, _params.MoeDecodeFp4GateUpParams),
     "moe_decode_fp4_gate_up<true, false, false>", False),
    (_params.MoeDecodeFp4DownParams, _alone(fused_moe.DECODE_SOURCE_NAME, _params.MoeDecodeFp4DownParams),
     "moe_decode_fp4_down<true, true>", False),
    (_params.Fp4MmParams, fp4_mm.source, "fp4_mm_gemv<4, true, false, 0>", False),
    # Two TMA maps, then the rest.
    (_params.ScaledMmParams, scaled_mm.source, "scaled_mm_sm90<0, 4, 2>", True),
    (_params.QuantizeGroupsParams, lambda names: quantize_fp8.source(names, []), "quantize_groups<0, false, 16, 4>",
     False),
    (_params.QuantizeRowsParams, lambda names: quantize_fp8.source([], names), "quantize_rows<0, true, 2, 4>", False),
    (_params.QuantizeFp4Params, _quantize_fp4.source, "quantize_fp4<1, 0, true, 4>", False),
])
def test_the_kernels_parameters_are_the_mirrors_fields(mirror, source, name, arch_specific):
    # The launch points the driver at each field of the mirror, which copies as many bytes as the
    # cubin's parameter of that ordinal has. Offsets are the struct's up to a TMA map, which sits
    # 64-byte aligned in the constant bank (48 bytes in on sm_90), not at the struct's 0.
    names = (name,) if source is _paged_decode.source else [name]
    module = _compile.compile_module(source(names), [name], (9, 0), arch_specific=arch_specific)
    found = _kernel_params(module.cubin, module.names[name])
    assert [size for _, size in found] == [getattr(mirror, field).size for field, _ in mirror._fields_]
    if not any(kind is _driver.TensorMap for _, kind in mirror._fields_):
        assert [offset for offset, _ in found] == [getattr(mirror, field).offset for field, _ in mirror._fields_]
