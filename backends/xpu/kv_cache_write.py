"""The xpu backend's kv_cache_write: vllm-xpu-kernels' reshape_and_cache_flash (csrc/cache.cpp), which copies
each token's Hkv * D elements as one run into its slot, quantizing with a true division for fp8 caches;
caches whose heads are not one run per slot are written one kv head at a time."""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from kernelmux.platforms import Platform
from kernelmux.specs import kv_cache_write as spec

__all__ = ["cache_dtype_name", "kv_cache_write", "supports"]

_log = logging.getLogger("kernelmux.backends.xpu")
_lock = threading.Lock()
_announced: set[tuple] = set()  # cache layouts already logged as written per head


def supports(key: spec.Key, platform: Platform) -> Optional[str]:
    """None when reshape_and_cache_flash writes calls with this key as the spec defines them."""
    for name in ("key", "value", "k_cache", "v_cache"):
        tensor_layout = getattr(key, f"{name}_layout")
        if not tensor_layout.unit_stride:
            return (f"{name} needs a unit stride along the head dim (the kernel copies runs of elements), "
                    f"got {tensor_layout}")
    return None


def cache_dtype_name(cache: torch.Tensor) -> str:
    """The kernel's kv_cache_dtype: "auto" copies in the input dtype; "fp8_e4m3" stores
    e4m3fn(clamp(x / scale, +-448)) (CopyWithScaleOp, quant_utils.h: a true division, saturating, the
    c10 cast rounding to nearest even), the spec's rule bit for bit."""
    return "fp8_e4m3" if cache.dtype == spec.FP8 else "auto"


def _runs(cache: torch.Tensor) -> bool:
    """Whether each slot's Hkv * D elements are one run: the only layout the kernel's plain path reads
    (a head stride other than D, even of a single head, selects its interleaved-cache path, which
    needs another layout: is_strided_head in cache.cpp)."""
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]


def _rows(new: torch.Tensor) -> bool:
    """Whether each token's Hkv * D input elements are one run from ``new + t * new.stride(0)``."""
    return new.stride(2) == 1 and (new.shape[1] == 1 or new.stride(1) == new.shape[2])


def _head(cache: torch.Tensor, head: int) -> torch.Tensor:
    """Kv head ``head`` of ``cache`` as a one-head cache whose (size-1) head dim has stride D: the same
    elements, in the layout the plain path reads."""
    view = cache[:, :, head:head + 1]
    return view.as_strided(view.shape, (view.stride(0), view.stride(1), view.shape[3], 1))


def _announce(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Log once per cache layout that it is written one kv head at a time (2 * Hkv launches a call)."""
    layout = (k_cache.stride(), v_cache.stride())
    with _lock:
        if layout in _announced:
            return
        _announced.add(layout)
    _log.warning("kernelmux: xpu kv_cache_write: caches with strides %s (k) and %s (v) are not the layout "
                 "reshape_and_cache_flash reads in one launch (each slot's heads one run, K and V alike): written "
                 "one kv head at a time, %d launches per call", *layout, 2 * k_cache.shape[2])


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """The spec's kv_cache_write on _C.reshape_and_cache_flash; arguments are validated by the caller and
    accepted by ``supports``. Negative slots are skipped by the kernel (``if (slot_idx < 0) return``)."""
    import vllm_xpu_kernels._C  # noqa: F401 - registers torch.ops._C

    if key.shape[0] == 0:
        return
    dtype = cache_dtype_name(k_cache)
    one = torch.ones(1, dtype=torch.float32, device=key.device)  # the schema's scales are not optional
    k_scale = one if k_scale is None else k_scale
    v_scale = one if v_scale is None else v_scale
    slots = slot_mapping.contiguous()

    def write(k, v, kc, vc, ks, vs):
        torch.ops._C.reshape_and_cache_flash(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots,
                                             kv_cache_dtype=dtype, k_scale=ks, v_scale=vs)

    # The kernel reads a token's elements as one run (this step's rows: a copy is cheap).
    key = key if _rows(key) else key.contiguous()
    value = value if _rows(value) else value.contiguous()
    if _runs(k_cache) and _runs(v_cache) and k_cache.stride()[:2] == v_cache.stride()[:2]:
        # One launch: V is addressed with K's block and page strides (cache.cpp).
        write(key, value, k_cache, v_cache, k_scale, v_scale)
        return
    # Any other layout: one launch per tensor and kv head, each head a one-head cache of its own; the
    # kernel writes its key and value arguments alike, so both name the same tensor (identical bytes).
    _announce(k_cache, v_cache)
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        for head in range(cache.shape[2]):
            rows, slots_view = new[:, head:head + 1], _head(cache, head)
            write(rows, rows, slots_view, slots_view, scale, scale)
