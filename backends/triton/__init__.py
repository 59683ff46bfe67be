"""The triton backend: Triton kernels for CUDA (and any Triton target; on CPU only under
TRITON_INTERPRET=1, as a correctness tool ranked below the cpu backend)."""

from __future__ import annotations

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends.triton._host import INTERPRETED as _INTERPRETED
from kernelmux.backends.triton._host import triton_cache_dir
from kernelmux.platforms import PlatformKind
from kernelmux.registry import Backend, Implementation, JitCache, PlatformRequirement, hookimpl

# Under TRITON_INTERPRET=1 the interpreter runs kernels on CPU tensors, far slower than the cpu
# backend, so there it is viable but ranked last.
_GPU_KINDS = frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.XPU})
_DEFAULTS = Defaults(
    priority=-10 if _INTERPRETED else 20,
    requirement=PlatformRequirement() if _INTERPRETED else PlatformRequirement(kinds=_GPU_KINDS),
    devices=frozenset({"cuda", "xpu", "cpu"} if _INTERPRETED else {"cuda", "xpu"}),
    packages=("triton",),
    jit=None if _INTERPRETED else JitCache("Triton JIT", triton_cache_dir, "one kernel per dtype and constexpr set"),
)

TABLE = (
    Entry("grouped_topk",
          "one fused kernel: scoring, bias, group top-2, group and expert top-k, renormalize, scale"),
    Entry("paged_attention",
          "tiled flash attention over the paged cache: GQA heads x tokens as rows, split-KV "
          "with a merge kernel when the grid is small"),
    Entry("kv_cache_write",
          "one scatter kernel: a few tokens' K and V rows per program, fp8 quantized in flight"),
    Entry("fused_moe",
          "routing laid out on the device in expert blocks, gate-up GEMM with the activation fused, "
          "down GEMM with the router weight and top-k sum fused (fp8 quantized, fp4 dequantized in the "
          "mainloops); fp4 decode steps in two GEMVs with no routing layout"),
    Entry("quantize_fp8",
          "per token and per 1 x G group in one launch, per tensor in one (few rows) or two (maxima, then "
          "codes); e4m3fn and e4m3fnuz"),
    Entry("quantize_nvfp4",
          "blocks of 16 in one launch (a passed-in global scale, or a few rows), else the amax partials first"),
    Entry("quantize_mxfp4", "blocks of 32 in one launch, OCP's floor or the ceil scale rule"),
    Entry("fp4_mm",
          "W4A16: weights decoded in the mainloop, GEMVs on the CUDA cores for a few rows, else tensor-core "
          "tiles; from 32 rows on NVIDIA GPUs the weights decoded once for torch's GEMM; W4A4 declined (the "
          "vendors' fp4 tensor cores)"),
    # Below the vendors' GEMMs (15-17) and the cuda backend's Hopper kernel (14) where no tuning table ranks them:
    # half DeepGEMM's speed at M 4096 on the H200 (perf/decisions/scaled_mm.md); the tables put it first where it
    # measured fastest (decode).
    Entry("scaled_mm",
          "tiled fp8 GEMM with every scale layout and the bias fused; at decode sizes split-K over the weight "
          "stream, the slices summed in one more launch",
          {"priority": -10 if _INTERPRETED else 13}),
    Entry("mla_decode",
          "the paged-attention kernel with one latent head: heads as rows, values from the "
          "key tile, split-KV with a merge kernel"),
    Entry("selective_state_update",
          "one launch: a program per request and rows of a head, its state tile read and written once in place, "
          "padding slots untouched"),
    Entry("ssd_scan",
          "the chunked SSD in five or six launches: chunk table from cu_seqlens on the device, dt' and its running "
          "sums, C.B per group, the states entering the chunks (a walk over each sequence's chunks, or chunk states "
          "and state passing when the walk would not fill the SMs), the scan with D and z fused"),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return implementations(Backend.TRITON, __name__, _DEFAULTS, TABLE)
