"""The cuda backend: hand-written CUDA C++ kernels (kernels/) for NVIDIA GPUs, compiled at runtime
by NVRTC and launched through the driver API, for the calls where a Triton kernel leaves bandwidth
or FLOPs on the table. One table: paged_attention (paged_attention.py), mla_decode (mla_decode.py), fused_moe
(fused_moe.py), fp4_mm (fp4_mm.py), scaled_mm (scaled_mm.py), quantize_fp8 (quantize_fp8.py), quantize_nvfp4 and
quantize_mxfp4 (quantize_nvfp4.py, quantize_mxfp4.py; one kernel: _quantize_fp4.py)."""

from __future__ import annotations

from typing import Optional

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends.cuda._targets import DECODE_MIN_CAPABILITY, HOPPER
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl


def _nvrtc_problem(platform: Platform) -> Optional[str]:
    """Every kernel of the backend is compiled at first use: without NVRTC none can run."""
    from kernelmux.backends.cuda import _toolchain

    if _toolchain.find_nvrtc() is None:
        return "NVRTC not found (pip install nvidia-cuda-nvrtc, which torch's CUDA wheels bring, or a CUDA toolkit)"
    return None


def _cache_dir() -> str:
    from kernelmux.backends.cuda._compile import cache_dir

    return cache_dir()


_CUDA = frozenset({PlatformKind.CUDA})

# Above the triton backend (20): each implementation takes only the calls it was written for.
_DEFAULTS = Defaults(
    priority=30,
    requirement=PlatformRequirement(kinds=_CUDA),
    devices=frozenset({"cuda"}),
    static_check=_nvrtc_problem,
    jit=JitCache("NVRTC", _cache_dir, "one module per kernel source, defines and arch"),
)

TABLE = (
    # The decode kernel's floor; the prefill kernel's sm_90 is asked per call.
    Entry("paged_attention",
          "fp8-cache decode, head dim 128: each warp streams its own KV steps with 16-byte loads straight "
          "into MMA fragments (positions as rows), warps combined once; Hopper prefill of 16-bit caches: "
          "warp-specialized wgmma",
          {"requirement": PlatformRequirement(kinds=_CUDA, min_capability=DECODE_MIN_CAPABILITY)}),
    # sm_90a cubins (wgmma) run on sm_90 only: not on sm_100 or sm_120.
    Entry("mla_decode",
          "Hopper, 16-bit or fp8 latent cache: 64-head CTAs, Q and two 64-position cache tiles in shared "
          "memory; warpgroup 0 runs Q K^T (wgmma) and the softmax, warpgroup 1 the loads, each half of P V",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    # 1.02-1.41x triton's kernels at every H200 shape it serves that was measured (fp8_block: 1.13-1.31x at
    # DeepSeek-V3 T 2048-4096), the decode GEMVs 1.17x at Qwen3-30B-A3B T = 1 (perf/decisions/fused_moe.md).
    Entry("fused_moe",
          "Hopper, 16-bit and 128-block fp8 experts at prefill sizes: routing in one CTA, then grouped GEMMs of "
          "128-row blocks where a producer warpgroup gathers A rows by cp.async and loads B tiles by TMA, and two "
          "consumers run wgmma (gate-up's activation, fp8's intermediate quantization and down's router weight in "
          "their epilogues; fp8 sums promoted per 128-K block with the block scales); at T = 1 with small or fp4 "
          "experts, two GEMVs (no routing launch, down summing the top-k)",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    # 1.04-1.48x triton at M 1, 1.6-3.8x at M 4, 1.06-2.6x at M 16 on every H200 goal shape (perf/decisions/fp4_mm.md).
    Entry("fp4_mm",
          "Hopper, W4A16 up to 32 rows of a: a CTA a 16 weight rows, its warps splitting K; the codes decoded in "
          "registers into exactly scaled 16-bit pairs once for all rows of a, m16n8k16 MMAs with a's rows as B columns",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    # sm_90a cubins (wgmma, TMA) run on sm_90 only. Between torch's cuBLASLt (15) and triton (13), as measured on the
    # H200 from M 256: 0.82-0.92x cuBLASLt, 1.5-1.7x triton, 0.81-0.82x DeepGEMM's kernel at M 4096
    # (perf/decisions/scaled_mm.md).
    Entry("scaled_mm",
          "Hopper, 128-block scales from M 256: persistent CTAs over 128 x 128 or 256 x 128 tiles by TMA (a producer "
          "warpgroup), two consumer warpgroups of fp8 wgmma, each 128-K product promoted to fp32 with its block "
          "scales on the CUDA cores",
          {"priority": 14,
           "requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    # The kernels need sm_89's e4m3 cvt only; registered on Hopper, where they are measured: 1.0-2.3x triton on the
    # H200 goal shapes but per_tensor at H 2048 (0.88-0.94x; perf/decisions/quantize_fp8.md).
    Entry("quantize_fp8",
          "e4m3fn codes from rows of 16-byte vectors, a few SASS instructions an element: per_group warp tasks of "
          "several groups a lane in flight (maxima by shuffles), per_token a CTA a row held in registers, "
          "per_tensor one CTA or two launches (maxima, then codes in reverse order); scales in either layout",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    # quantize_fp4.cu needs sm_89's e4m3 cvt only; registered on Hopper, where it is measured: 1.2-1.6x triton at T 4096
    # on the H200, within 0.3 us either way at T 1 (perf/decisions/quantize_nvfp4.md).
    Entry("quantize_nvfp4",
          "e2m1 codes in blocks of 16 from rows of 16-byte vectors: warp tasks of several blocks a lane in flight "
          "(maxima by shuffles), an FFMA-rounding integer encoder; a passed-in global scale in one launch, a dynamic "
          "one after quantize_fp8's per-CTA maxima; scales straight to either layout",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
    Entry("quantize_mxfp4",
          "e2m1 codes in blocks of 32 with e8m0 scales (floor or ceil) in one launch, quantize_nvfp4's kernel",
          {"requirement": PlatformRequirement(kinds=_CUDA, archs=frozenset({f"sm_{HOPPER[0]}{HOPPER[1]}"}))}),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return implementations(Backend.CUDA, __name__, _DEFAULTS, TABLE)
