"""The triton backend's kv_cache_write: which calls the scatter kernel takes, its tile and launch
configuration (a heuristic, with an override for sweeps and tests), the fp8 route and the launch
(kernel: _kv_cache_write_kernel.py, imported on the first launch: no Triton needed to register)."""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import device_guard, force_software_fp8, native_fp8_cast, next_pow2
from kernelmux.platforms import Platform
from kernelmux.specs import kv_cache_write as kv_cache_write_spec

__all__ = [
    "LaunchConfig",
    "MAX_PADDED_HEAD_DIM",
    "MAX_TILE",
    "force_software_fp8",
    "kv_cache_write",
    "launch_config",
    "native_fp8_cast",
    "override_launch_config",
    "supports",
    "tile_shape",
]

FP8 = torch.float8_e4m3fn

# Elements of one tensor a program holds per head chunk: 8 warps x 32 threads x 16 elements, i.e.
# two 16-byte vectors of bf16 per thread for K and two for V. Rows of more heads are written in
# head chunks by a loop inside the program (MHA at 64 heads x 128 = 8192 elements: two chunks).
MAX_TILE = 4096
# One head's padded dim must fit a tile; no attention kernel uses head dims anywhere near this.
MAX_PADDED_HEAD_DIM = MAX_TILE
# The access width the tile is sized for: 16-byte vectors (ld.global.v4 / st.global.v4), the
# widest single access, which is what a memory-bound copy wants.
_VECTOR_BYTES = 16
_WARP = 32
_MAX_BLOCK_T = 16
_MAX_WARPS = 8


def tile_shape(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): the padded head dim, and as many heads (a power of two, at most all of
    them) as fit MAX_TILE elements."""
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, MAX_TILE // block_d))
    return block_h, block_d


@dataclass(frozen=True)
class LaunchConfig:
    """Tokens each program writes, and warps per program."""

    block_t: int
    num_warps: int


def _config_problem(config: LaunchConfig) -> Optional[str]:
    if config.block_t < 1 or config.block_t & (config.block_t - 1):
        return f"block_t must be a power of two >= 1 (a tile dimension), got {config.block_t}"
    return None


# The launch configuration in force instead of the heuristic (None: the heuristic's).
_override: ScopedSetting[Optional[LaunchConfig]] = ScopedSetting("override_launch_config", None, _config_problem)


def launch_config(num_kv_heads: int, head_dim: int, element_size: int) -> LaunchConfig:
    """The launch configuration: the active override if any, else the heuristic below.

    Sized from the access width, not swept: 87% of copy on an H100 at 8192 Llama-3-8B tokens, 2-5
    us (launch-bound) at 1024 and fewer, perf/decisions/kv_cache_write.md; no other block_t / warps
    has been timed. One warp moving one 16-byte vector per thread covers 32 * 16 / element_size
    elements (256 for bf16/fp16). A program takes enough tokens to fill that warp when rows are
    small (Hkv * D < 256: e.g. 1 head of 64 -> 4 tokens), and one warp per such 256 elements of
    its tile, capped at 8: Llama-3-8B's 8 x 128 row is 4 warps of one vector per thread for K and
    one for V; 32 x 128 is 8 warps of two. Small programs (one token each for real rows) keep the
    scattered slots of a decode batch spread over every SM, and there is no reuse that bigger
    programs would exploit.
    """
    if _override.current is not None:
        return _override.current
    block_h, block_d = tile_shape(num_kv_heads, head_dim)
    tile = block_h * block_d
    warp_elements = _WARP * max(1, _VECTOR_BYTES // element_size)
    block_t = min(_MAX_BLOCK_T, max(1, warp_elements // tile))
    num_warps = min(_MAX_WARPS, max(1, block_t * tile // warp_elements))
    return LaunchConfig(block_t=block_t, num_warps=num_warps)


def override_launch_config(config: LaunchConfig) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Use ``config`` for every launch inside the block (sweeps; the interpreter's big cases);
    restores the previous one."""
    return _override.override(config)


@functools.cache
def _kernel():
    from kernelmux.backends.triton._kv_cache_write_kernel import kv_cache_write_kernel

    return kv_cache_write_kernel


def supports(key: kv_cache_write_spec.Key, platform: Platform) -> Optional[str]:
    """None when the kernel handles calls with this dispatch key, else why not (it reads any
    strides). The engine checks the tensors' device against the record's ``devices`` before
    asking."""
    head_dim = key.head_dim
    if next_pow2(head_dim) > MAX_PADDED_HEAD_DIM:
        return (
            f"head dim D = {head_dim} pads to {next_pow2(head_dim)} > {MAX_PADDED_HEAD_DIM} lanes: "
            "one head does not fit the kernel's register tile"
        )
    return None


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """The spec's kv_cache_write in one kernel launch; arguments are validated by the caller."""
    if key.shape[0] > 0:
        _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return None


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
):
    """The launch (T > 0); returns what Triton's launch returns (the compiled kernel when
    compiled: tests read its PTX)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    device = key.device
    fp8 = k_cache.dtype == FP8
    if fp8:
        # The kernel stores the codes it computed as bytes.
        k_dst, v_dst = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_src, v_src = key, value
    else:
        # Same dtype on both sides: the kernel copies bits (a view keeps every stride).
        k_dst, v_dst = k_cache.view(torch.int16), v_cache.view(torch.int16)
        k_src, v_src = key.view(torch.int16), value.view(torch.int16)
    slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
    block_h, block_d = tile_shape(num_kv_heads, head_dim)
    config = launch_config(num_kv_heads, head_dim, key.element_size())
    grid = (-(-num_tokens // config.block_t),)
    with device_guard(device):
        return _kernel()[grid](
            k_src,
            v_src,
            k_dst,
            v_dst,
            slots,
            k_scale if k_scale is not None else slots,  # never read without a scale
            v_scale if v_scale is not None else slots,
            num_tokens,
            k_cache.shape[1],
            *k_src.stride(),
            *v_src.stride(),
            *k_dst.stride(),
            *v_dst.stride(),
            NUM_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_T=config.block_t,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            FP8=fp8,
            HAS_K_SCALE=fp8 and k_scale is not None,
            HAS_V_SCALE=fp8 and v_scale is not None,
            NATIVE_FP8=fp8 and native_fp8_cast(device),
            num_warps=config.num_warps,
        )
