"""The cuda backend: hand-written CUDA C++ kernels for NVIDIA GPUs, compiled at runtime by NVRTC
and launched through the driver API (_nvrtc.py), for the cases where a Triton kernel leaves
bandwidth on the table. Now: paged_attention decode over fp8 e4m3 caches (attention.py) and
mla_decode over bf16/fp16 and fp8 latent caches on Hopper (mla.py)."""

from __future__ import annotations

from kernelmux.engine.platform import PlatformKind
from kernelmux.ops.specs import mla_decode as mla_decode_spec
from kernelmux.ops.specs import paged_attention as paged_attention_spec
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.cuda import attention, mla

    return [
        Implementation(
            op=paged_attention_spec.NAME,
            backend=Backend.CUDA,
            fn=attention.paged_attention,
            supports=attention.paged_attention_supports,
            spec_version=paged_attention_spec.SPEC.version,
            # Above the triton backend (20): it takes only the calls it was written for.
            priority=30,
            requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                            min_capability=attention.MIN_CAPABILITY),
            devices=frozenset({"cuda"}),
            description="fp8-cache decode, head dim 128: each warp streams its own KV steps with 16-byte "
                        "loads straight into MMA fragments (positions as rows), warps combined once",
        ),
        Implementation(
            op=mla_decode_spec.NAME,
            backend=Backend.CUDA,
            fn=mla.mla_decode,
            supports=mla.mla_decode_supports,
            spec_version=mla_decode_spec.SPEC.version,
            priority=30,  # above the triton backend, for the calls it takes
            requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA}),
                                            min_capability=mla.CAPABILITY),
            devices=frozenset({"cuda"}),
            description="Hopper, 16-bit or fp8 latent cache: 64-head CTAs, Q and two 64-position cache tiles "
                        "in shared memory; warpgroup 0 runs Q K^T (wgmma) and the softmax, warpgroup 1 the "
                        "loads, each half of P V",
        ),
    ]
