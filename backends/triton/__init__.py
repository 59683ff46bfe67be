"""The triton backend: Triton kernels for CUDA (and any Triton target; on CPU only under
TRITON_INTERPRET=1, as a correctness tool ranked below the cpu backend)."""

from __future__ import annotations

from kernelmux.backends.triton._host import INTERPRETED as _INTERPRETED
from kernelmux.platforms import PlatformKind
from kernelmux.specs import grouped_topk as grouped_topk_spec
from kernelmux.specs import kv_cache_write as kv_cache_write_spec
from kernelmux.specs import mla_decode as mla_decode_spec
from kernelmux.specs import paged_attention as paged_attention_spec
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl

# Under TRITON_INTERPRET=1 the interpreter runs kernels on CPU tensors, far slower than the cpu
# backend, so there it is viable but ranked last.
_GPU_KINDS = frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.XPU})


def _triton(spec_module, fn, supports, description: str) -> Implementation:
    return Implementation(
        op=spec_module.NAME,
        backend=Backend.TRITON,
        fn=fn,
        supports=supports,
        spec_version=spec_module.SPEC.version,
        priority=-10 if _INTERPRETED else 20,
        requirement=PlatformRequirement() if _INTERPRETED else PlatformRequirement(kinds=_GPU_KINDS),
        devices=frozenset({"cuda", "xpu", "cpu"} if _INTERPRETED else {"cuda", "xpu"}),
        packages=("triton",),
        description=description,
    )


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    from kernelmux.backends.triton import attention, grouped_topk, kv_cache_write

    return [
        _triton(grouped_topk_spec, grouped_topk.grouped_topk, grouped_topk.supports,
                "one fused kernel: scoring, bias, group top-2, group and expert top-k, renormalize, scale"),
        _triton(paged_attention_spec, attention.paged_attention, attention.paged_attention_supports,
                "tiled flash attention over the paged cache: GQA heads x tokens as rows, split-KV "
                "with a merge kernel when the grid is small"),
        _triton(kv_cache_write_spec, kv_cache_write.kv_cache_write, kv_cache_write.supports,
                "one scatter kernel: a few tokens' K and V rows per program, fp8 quantized in flight"),
        _triton(mla_decode_spec, attention.mla_decode, attention.mla_decode_supports,
                "the paged-attention kernel with one latent head: heads as rows, values from the "
                "key tile, split-KV with a merge kernel"),
    ]
