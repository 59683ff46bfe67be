"""The cuda backend: hand-written CUDA C++ kernels for NVIDIA GPUs, compiled at runtime by NVRTC
and launched through the driver API (_nvrtc.py), for the cases where a Triton kernel leaves
bandwidth on the table. Now: paged_attention decode over fp8 e4m3 caches (attention.py) and
prefill on Hopper (prefill.py), and mla_decode over bf16/fp16 and fp8 latent caches on Hopper
(mla.py)."""

from __future__ import annotations

from typing import Optional

from kernelmux.platforms import Platform, PlatformKind
from kernelmux.specs import mla_decode as mla_decode_spec
from kernelmux.specs import paged_attention as paged_attention_spec
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl


def _nvrtc_problem(platform: Platform) -> Optional[str]:
    """Every kernel of the backend is compiled at first use: without NVRTC none can run."""
    from kernelmux.backends.cuda import _nvrtc

    if _nvrtc.find_nvrtc() is None:
        return "NVRTC not found (pip install nvidia-cuda-nvrtc, which torch's CUDA wheels bring, or a CUDA toolkit)"
    return None


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.cuda import attention, mla

    cuda = frozenset({PlatformKind.CUDA})
    return [
        Implementation(
            op=paged_attention_spec.NAME,
            backend=Backend.CUDA,
            fn=attention.paged_attention,
            supports=attention.paged_attention_supports,
            static_check=_nvrtc_problem,
            spec_version=paged_attention_spec.SPEC.version,
            # Above the triton backend (20): it takes only the calls it was written for.
            priority=30,
            # The decode kernel's floor; the prefill kernel's sm_90 is asked per call.
            requirement=PlatformRequirement(kinds=cuda, min_capability=attention.MIN_CAPABILITY),
            devices=frozenset({"cuda"}),
            description="fp8-cache decode, head dim 128: each warp streams its own KV steps with 16-byte "
                        "loads straight into MMA fragments (positions as rows), warps combined once; "
                        "Hopper prefill of 16-bit caches: warp-specialized wgmma",
        ),
        Implementation(
            op=mla_decode_spec.NAME,
            backend=Backend.CUDA,
            fn=mla.mla_decode,
            supports=mla.mla_decode_supports,
            static_check=_nvrtc_problem,
            spec_version=mla_decode_spec.SPEC.version,
            priority=30,  # above the triton backend, for the calls it takes
            # sm_90a cubins (wgmma) run on sm_90 only: not on sm_100 or sm_120.
            requirement=PlatformRequirement(kinds=cuda, archs=frozenset({mla.ARCH})),
            devices=frozenset({"cuda"}),
            description="Hopper, 16-bit or fp8 latent cache: 64-head CTAs, Q and two 64-position cache tiles "
                        "in shared memory; warpgroup 0 runs Q K^T (wgmma) and the softmax, warpgroup 1 the "
                        "loads, each half of P V",
        ),
    ]
