"""The deepgemm backend: DeepGEMM's FP8 GEMMs (sgl-deep-gemm, JIT-compiled per shape at first use)
behind kernelmux's specs, called by keyword through the vendor mechanism (backends/_vendor.py).
Now: scaled_mm (fp8_gemm_nt, block scales, sm_90); fused_moe (m_grouped_fp8_gemm_nt_contiguous, declined
until a GPU run confirms it)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends._vendor import Vendor, VendorCall
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl

DEEPGEMM = Vendor(
    name="deep_gemm",
    distribution="sgl-deep-gemm",
    tested=((0, 1, 4), (0, 2)),  # 0.1.4.post1: SGLang's build for torch 2.11 + CUDA 13, measured on the H100
    extra="deepgemm",
)

# Per op, the vendor functions its entry module calls (probed at startup as that op's static check).
# All are Python wrappers in deep_gemm/__init__.py or deep_gemm/utils/layout.py (over the tvm-ffi module
# _C, whose own functions inspect.signature cannot read), so their keywords can be probed.
CALLS: dict[str, tuple[VendorCall, ...]] = {
    "scaled_mm": (
        VendorCall("deep_gemm", "fp8_gemm_nt", ("a", "b", "d", "c", "recipe", "compiled_dims")),
        VendorCall("deep_gemm", "transform_sf_into_required_layout", ("sf", "mn", "k", "recipe", "is_sfa")),
    ),
    "fused_moe": (
        VendorCall("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous",
                   ("a", "b", "d", "grouped_layout", "recipe", "compiled_dims")),
        VendorCall("deep_gemm", "transform_sf_into_required_layout",
                   ("sf", "mn", "k", "recipe", "num_groups", "is_sfa")),
        # utils/layout.py's wrapper (re-exported by `from .utils import *`), no parameters.
        VendorCall("deep_gemm", "get_mk_alignment_for_contiguous_layout", ()),
    ),
}

SM90 = (9, 0)


def arch_problem(platform: Platform) -> Optional[str]:
    """Why DeepGEMM's kernels for fp32 scales cannot run on ``platform`` (None on sm_90): a static
    check of every deepgemm implementation, so `info --platform sm_100` does not list them."""
    if platform.capability == SM90:
        return None
    if platform.capability is not None and platform.capability[0] == 10:
        # transform_sf_into_required_layout packs fp32 scales into UE8M0 on sm_100 by keeping their
        # exponent bits (x >> 23 in smxx_layout.cuh): exact only for power-of-two scales, a property
        # of the values that no dispatch key holds.
        return ("on sm_100 DeepGEMM takes UE8M0 scales only: it truncates fp32 scales to their power of "
                "two, exact only when every scale is one (not known from the key)")
    return f"DeepGEMM's FP8 GEMMs with fp32 scales run on sm_90 only, not {platform.arch}"


def transform_scales(sf: torch.Tensor, **kwargs) -> torch.Tensor:
    """DeepGEMM's ``transform_sf_into_required_layout(sf=sf, **kwargs)`` as a tensor that keeps its memory.

    Where no transform is needed the shipped one (0.1.4.post1, through tvm-ffi) returns its input as a
    tensor that does not hold the input's memory: a temporary ``sf`` (a ``.contiguous()`` copy) is freed
    on return and its block reused, so the GEMM read scales another tensor had overwritten (the H200 kit:
    zeros from fused_moe, values near 1e38 from scaled_mm, only for strided scales). Such a result is
    given back as a view of ``sf`` itself."""
    from deep_gemm import transform_sf_into_required_layout

    out = transform_sf_into_required_layout(sf=sf, **kwargs)
    storage = sf.untyped_storage()
    start = out.data_ptr() - storage.data_ptr()
    if out.dtype == sf.dtype and 0 <= start < storage.nbytes():
        return sf.as_strided(out.shape, out.stride(), start // sf.element_size())
    return out


def _static_check(op: str):
    return lambda platform: DEEPGEMM.problem_for(CALLS[op]) or arch_problem(platform)


def _jit_dir() -> str:
    """DeepGEMM's JIT cache: $DG_JIT_CACHE_DIR, else ~/.deep_gemm."""
    return os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")


_DEFAULTS = Defaults(
    priority=15,
    requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA})),
    devices=frozenset({"cuda"}),
    jit=JitCache("DeepGEMM JIT (nvcc, or NVRTC if DG_JIT_USE_NVRTC=1)", _jit_dir,
                 "one kernel per weight shape and block shape (a new M may pick another)"),
)

TABLE: tuple[Entry, ...] = (
    Entry("scaled_mm",
          "fp8_gemm_nt (sm90_fp8_gemm_1d2d): block scales (1x128 x 128x128), e4m3fn, bf16 out, no bias, "
          "K % 128 == 0, N % 8 == 0, sm_90; JIT per (N, K)",
          # Ahead of flashinfer's (16) and torch's (15) block GEMMs: fastest of the three on every
          # DeepSeek-V3 case of the H100 bench (perf/decisions/scaled_mm.md).
          {"priority": 17}),
    Entry("fused_moe",
          "m_grouped_fp8_gemm_nt_contiguous (sm90 1D2D) for gate_up and down: DeepSeek-V3 fp8_block experts "
          "(e4m3fn, bf16 hidden, H and I % 128 == 0, sm_90); routing, 1x128 quantization and activation in "
          "torch, no host sync, CUDA-graph capturable",
          # Behind the triton backend's kernels (20): on the H200 DeepSeek-V3 took 349 us / 5.60 ms /
          # 12.0 ms here at T 1 / 64 / 4096 against triton's 118 us / 2.26 ms / 7.12 ms
          # (perf/decisions/fused_moe.md).
          {"priority": 19}),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    version = f"{DEEPGEMM.distribution} {DEEPGEMM.version() or '(not installed)'}: "
    table = [Entry(entry.op, version + entry.description,
                   {"static_check": _static_check(entry.op), **entry.overrides})
             for entry in TABLE]
    return implementations(Backend.DEEPGEMM, __name__, _DEFAULTS, table)
