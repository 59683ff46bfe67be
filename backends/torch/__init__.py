"""The torch backend: torch's own fused ops where they are the vendor route (cuBLASLt through
``torch.nn.functional.scaled_mm``, CUTLASS grouped GEMMs through ``torch._grouped_mm``, KleidiAI's
int4 GEMM on Arm CPUs through ``_dyn_quant_matmul_4bit``), behind kernelmux's specs.
Nothing is compiled; what the installed torch can run is probed at startup."""

from __future__ import annotations

from kernelmux.backends._table import Defaults, Entry, implementations
from kernelmux.backends.torch._torch_api import grouped_mm_problem, kleidiai_problem, scaled_mm_problem
from kernelmux.platforms import Feature, PlatformKind
from kernelmux.registry import Backend, Implementation, PlatformRequirement, hookimpl

_CUDA = frozenset({PlatformKind.CUDA})

# Below kernelmux's own triton and cuda kernels until selection by measurement decides per op.
_DEFAULTS = Defaults(
    priority=15,
    requirement=PlatformRequirement(kinds=_CUDA),
    devices=frozenset({"cuda"}),
)

TABLE: tuple[Entry, ...] = (
    Entry("scaled_mm",
          "torch's FP8 GEMM on cuBLASLt: per-tensor, per-token x per-channel, 1x128 x 128x128 block "
          "scales (block: sm_90)",
          {"requirement": PlatformRequirement(kinds=_CUDA, features=frozenset({Feature.FP8})),
           "static_check": scaled_mm_problem}),
    Entry("fused_moe",
          "bf16 experts on torch._grouped_mm (CUTLASS, sm_90/sm_100): routing sorted on the device, "
          "no host sync, CUDA-graph capturable",
          {"requirement": PlatformRequirement(kinds=_CUDA, min_capability=(9, 0)),
           "static_check": grouped_mm_problem}),
    Entry("int4_mm",
          "KleidiAI's W4A8 GEMM on Arm through torch's _dyn_quant_pack_4bit_weight (per call) and "
          "_dyn_quant_matmul_4bit: int4 weights per channel or in bf16-scaled groups of 32k, activations "
          "quantized to int8 per row inside",
          {"requirement": PlatformRequirement(kinds=frozenset({PlatformKind.CPU}), archs=frozenset({"aarch64"}),
                                              features=frozenset({Feature.KLEIDIAI})),
           "devices": frozenset({"cpu"}),
           "static_check": kleidiai_problem}),  # priority 15: above the cpu backend's 10
)


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return implementations(Backend.TORCH, __name__, _DEFAULTS, TABLE)
