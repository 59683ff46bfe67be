"""The triton backend's grouped_topk: which calls the fused kernel takes, its launch configuration
(a measured table, with an override for sweeps and tests) and the one launch (kernel:
_grouped_topk_kernel.py, imported on the first launch so the backend registers without Triton)."""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kernelmux.backends._scoped import ScopedSetting
from kernelmux.backends.triton._host import device_guard, next_pow2
from kernelmux.platforms import Platform
from kernelmux.specs import grouped_topk as grouped_topk_spec

__all__ = [
    "LaunchConfig",
    "KNOWN_BAD_CONFIGS",
    "MAX_PADDED_EXPERTS",
    "MAX_UNROLLED_PICKS",
    "force_64bit_offsets",
    "grouped_topk",
    "launch_config",
    "override_launch_config",
    "supports",
]

# One row lives in registers as a next_pow2(G) x next_pow2(E / G) tile, with about five such tiles
# live at once (logits/scores, biased scores, candidates, ids, masks). At 1024 lanes and one row
# over 4 warps that is 8 values per thread per tile (~40 registers); 4096 lanes would need 16
# warps per row or spill to local memory, and the top-k rounds scan the whole row each time, so
# past this size a sort- or radix-based kernel is the right tool. Real routers are well inside it
# (DeepSeek-V3 256, Qwen3 128, Kimi-K2 384 -> 512 padded).
MAX_PADDED_EXPERTS = 1024
# Group and expert selection are unrolled loops (one full-row scan per pick): code size and
# compile time grow linearly with the count, and no known router picks more than a few dozen.
MAX_UNROLLED_PICKS = 32


_INT32_LIMIT = 2**31


def _needs_64bit_offsets(
    gating_output: torch.Tensor, topk: int, bias: Optional[torch.Tensor]
) -> bool:
    """Whether some element offset the kernel forms (logits, bias, outputs) can pass int32; the
    kernel then computes every offset in int64."""
    num_tokens, num_experts = gating_output.shape
    row_stride, expert_stride = gating_output.stride()
    last_logit = (num_tokens - 1) * row_stride + (num_experts - 1) * expert_stride
    last_bias = (num_experts - 1) * bias.stride(0) if bias is not None else 0
    return max(last_logit, last_bias, num_tokens * topk) >= _INT32_LIMIT


def _host_constexprs(
    gating_output: torch.Tensor, topk: int, bias: Optional[torch.Tensor]
) -> dict:
    """The kernel's host-chosen constexprs beyond the shape ones."""
    return {
        "OFFSETS_64": _force_64bit_offsets.current or _needs_64bit_offsets(gating_output, topk, bias),
        "FAST_DIV": _fast_div_available(),
    }


@functools.cache
def _fast_div_available() -> bool:
    """tl.math.fdiv(..., approx=True) (an approximate reciprocal) exists in this Triton."""
    import inspect

    import triton.language as tl

    try:
        return "approx" in inspect.signature(tl.math.fdiv).parameters
    except (TypeError, ValueError):
        return False


# Whether the kernel takes int64 offsets even when int32 ones would do.
_force_64bit_offsets = ScopedSetting("force_64bit_offsets", False)


@functools.cache
def _kernel():
    from kernelmux.backends.triton._grouped_topk_kernel import grouped_topk_kernel

    return grouped_topk_kernel


def force_64bit_offsets(force: bool = True) -> contextlib.AbstractContextManager[bool]:
    """Make the kernel use int64 offsets inside the block even when int32 ones would do (tests:
    the 64-bit path otherwise needs a > 8 GiB tensor); restores the previous setting."""
    return _force_64bit_offsets.override(force)


@dataclass(frozen=True)
class LaunchConfig:
    """Rows of the batch each program handles, and warps per program."""

    block_t: int
    num_warps: int


# Keyed on the token count and on next_pow2(E), a proxy for the padded tile width; the first row
# that fits wins. E <= 256, one row per 1-warp program: fastest at every T on an H200 at
# DeepSeek-V3 routing (13.44 us at T = 16384, runner-up (8, 2) 13.81), perf/decisions/grouped_topk.md;
# each pick's reductions stay inside one warp (single REDUX, no shared memory). The E <= 64 and
# E <= 1024 rows are register arithmetic, not measured; the GPU tests run every row's configuration.
_CONFIG_TABLE: tuple[tuple[float, int, LaunchConfig], ...] = (
    (64, 64, LaunchConfig(block_t=1, num_warps=1)),
    (2048, 64, LaunchConfig(block_t=16, num_warps=2)),
    (float("inf"), 64, LaunchConfig(block_t=32, num_warps=4)),
    (float("inf"), 256, LaunchConfig(block_t=1, num_warps=1)),
    (64, MAX_PADDED_EXPERTS, LaunchConfig(block_t=1, num_warps=4)),
    (float("inf"), MAX_PADDED_EXPERTS, LaunchConfig(block_t=4, num_warps=8)),
)

# Launch configurations refused because the kernel computes wrong ids with them under Triton 3.6
# on an H200, while the interpreter and every other (block_t, num_warps) in {1..32} x {1, 2, 4, 8}
# are right (test_every_launch_config_compiled, perf/diag/sweep_check.py): (2, 1) and (2, 2) at
# DeepSeek-V3 routing, (2, 4) at DeepSeek-V2's padded groups of 20, perf/decisions/grouped_topk.md.
# (2, 8) was not seen wrong but shares the 2-row tile, so the whole block_t = 2 family is refused
# until the cause (suspected: the lowering of the run-sort's reshape/split for a 2-row tile) is
# found.
KNOWN_BAD_CONFIGS = frozenset(LaunchConfig(block_t=2, num_warps=w) for w in (1, 2, 4, 8))

def _config_problem(config: LaunchConfig) -> Optional[str]:
    if config in KNOWN_BAD_CONFIGS:
        return f"{config} computes wrong results under Triton 3.6 (see KNOWN_BAD_CONFIGS); refused"
    return None


# The launch configuration in force instead of the table's (None: the table's).
_override: ScopedSetting[Optional[LaunchConfig]] = ScopedSetting("override_launch_config", None, _config_problem)


def launch_config(num_tokens: int, num_experts: int) -> LaunchConfig:
    """The launch configuration for a batch: the active override if any, else the table's."""
    if _override.current is not None:
        return _override.current
    padded = next_pow2(num_experts)
    for max_tokens, max_padded, config in _CONFIG_TABLE:
        if num_tokens <= max_tokens and padded <= max_padded:
            return config
    return _CONFIG_TABLE[-1][2]  # past the limits supports() refuses; kept total for sweeps


def override_launch_config(config: LaunchConfig) -> contextlib.AbstractContextManager[LaunchConfig]:
    """Use ``config`` for every launch inside the block (for sweeps); restores the previous one.
    Raises ValueError for a configuration in KNOWN_BAD_CONFIGS."""
    return _override.override(config)


def supports(key: grouped_topk_spec.Key, platform: Platform) -> Optional[str]:
    """None when the fused kernel handles calls with this dispatch key, else why not (it reads
    any strides of the logits and the bias). The engine checks the tensors' device against the
    record's ``devices`` before asking."""
    num_experts, num_expert_group = key.num_experts, key.num_expert_group
    group_size = num_experts // num_expert_group
    padded = next_pow2(num_expert_group) * next_pow2(group_size)
    if padded > MAX_PADDED_EXPERTS:
        return (
            f"E = {num_experts} in {num_expert_group} groups pads to {padded} > "
            f"{MAX_PADDED_EXPERTS} lanes: the row does not fit one register tile"
        )
    if key.topk > MAX_UNROLLED_PICKS:
        return f"topk = {key.topk} > {MAX_UNROLLED_PICKS}: expert selection is an unrolled loop"
    if key.topk_group < num_expert_group and key.topk_group > MAX_UNROLLED_PICKS:
        return (
            f"topk_group = {key.topk_group} > {MAX_UNROLLED_PICKS}: group selection is an unrolled loop"
        )
    return None


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's grouped_topk in one kernel launch; arguments are validated by the caller."""
    num_tokens, num_experts = gating_output.shape
    device = gating_output.device
    weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, topk), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids

    group_size = num_experts // num_expert_group
    config = launch_config(num_tokens, num_experts)
    bias = e_score_correction_bias
    has_bias = bias is not None
    grid = (-(-num_tokens // config.block_t),)
    with device_guard(device):
        _kernel()[grid](
            gating_output,
            bias if has_bias else gating_output,  # never read without a bias
            weights,
            ids,
            num_tokens,
            gating_output.stride(0),
            gating_output.stride(1),
            bias.stride(0) if has_bias else 0,
            # float(): an int factor would be specialized (1) or typed i32 and compile apart.
            float(routed_scaling_factor),
            NUM_GROUPS=num_expert_group,
            GROUP_SIZE=group_size,
            G_PAD=next_pow2(num_expert_group),
            GS_PAD=next_pow2(group_size),
            TOPK=topk,
            TOPK_PAD=next_pow2(topk),
            TOPK_GROUP=topk_group,
            SIGMOID=scoring_func == "sigmoid",
            HAS_BIAS=has_bias,
            RENORMALIZE=renormalize,
            BLOCK_T=config.block_t,
            num_warps=config.num_warps,
            **_host_constexprs(gating_output, topk, bias),
        )
    return weights, ids
