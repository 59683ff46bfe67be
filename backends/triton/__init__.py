"""The triton backend: Triton kernels for CUDA (and any Triton target; on CPU only under
TRITON_INTERPRET=1, as a correctness tool ranked below the cpu backend)."""

from __future__ import annotations

import os

from kernelmux.engine.platform import PlatformKind
from kernelmux.ops.specs import grouped_topk as grouped_topk_spec
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl

# Triton reads TRITON_INTERPRET when a kernel is decorated; the interpreter runs kernels on CPU
# tensors, far slower than the cpu backend, so there it is viable but ranked last.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
_GPU_KINDS = frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.XPU})


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.triton import grouped_topk

    return [
        Implementation(
            op=grouped_topk_spec.NAME,
            backend=Backend.TRITON,
            fn=grouped_topk.grouped_topk,
            supports=grouped_topk.supports,
            spec_version=grouped_topk_spec.SPEC.version,
            priority=-10 if _INTERPRETED else 20,
            requirement=PlatformRequirement() if _INTERPRETED else PlatformRequirement(kinds=_GPU_KINDS),
            devices=frozenset({"cuda", "xpu", "cpu"} if _INTERPRETED else {"cuda", "xpu"}),
            packages=("triton",),
            description="one fused kernel: scoring, bias, group top-2, group and expert top-k, "
            "renormalize, scale",
        )
    ]
