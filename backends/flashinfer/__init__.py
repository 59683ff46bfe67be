"""The flashinfer backend: FlashInfer's own kernels (flashinfer-python, JIT-compiled with nvcc at
first use) behind kernelmux's specs, called by keyword through the vendor mechanism (backends/_vendor.py).
Now: grouped_topk (fused_topk_deepseek)."""

from __future__ import annotations

from typing import Optional

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends._vendor import Vendor, VendorCall
from kernelmux.platforms import Platform, PlatformKind
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl

FLASHINFER = Vendor(
    name="flashinfer",
    distribution="flashinfer-python",
    tested=((0, 6, 14), (0, 7)),  # 0.6.14: the version measured on the H100 (its wheel fits the device carry)
    calls=(
        VendorCall("flashinfer.fused_moe", "fused_topk_deepseek",
                   ("scores", "bias", "n_group", "topk_group", "topk", "routed_scaling_factor", "topk_values",
                    "topk_indices")),
    ),
)


def _vendor_problem(platform: Platform) -> Optional[str]:
    return FLASHINFER.problem()


# Below kernelmux's own triton and cuda kernels until selection by measurement decides per op.
_DEFAULTS = Defaults(
    priority=15,
    requirement=PlatformRequirement(kinds=frozenset({PlatformKind.CUDA})),
    devices=frozenset({"cuda"}),
    static_check=_vendor_problem,
)

TABLE = (
    Entry("grouped_topk",
          "fused_topk_deepseek: sigmoid + bias, group top-2 sums, top-k, renormalized and scaled, one kernel "
          "(sm_89, sm_90, sm_100, sm_103, sm_120, sm_121)"),
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    # The installed version leads each description, so `kernelmux info` and the report name it.
    version = f"{FLASHINFER.distribution} {FLASHINFER.version() or '(not installed)'}: "
    table = [Entry(entry.op, version + entry.description, entry.overrides) for entry in TABLE]
    return implementations(Backend.FLASHINFER, __name__, _DEFAULTS, table)
