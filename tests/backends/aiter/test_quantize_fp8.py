"""The aiter backend's quantize_fp8: wired to dynamic_per_token_scaled_quant (the fake models its
kernel's arithmetic) and declined, at startup and per call, because that arithmetic is not the spec's."""

from __future__ import annotations

import pytest
import torch

from fakes import ask
from kernelmux.backends.aiter import QUANTIZE_FP8_REASON
from kernelmux.backends.aiter import quantize_fp8 as adapter
from kernelmux.engine import Engine, Settings
from kernelmux.platforms import simulate
from kernelmux.specs import ALL_SPECS
from kernelmux.specs import quantize_fp8 as spec


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_rejected_at_startup_with_the_arithmetic(install_aiter, arch):
    install_aiter(arch)
    engine = Engine(ALL_SPECS, Settings(platform=arch))
    rejected = {impl.backend: why for impl, why in engine.tables["quantize_fp8"].rejected}
    assert rejected["aiter"] == QUANTIZE_FP8_REASON
    kwargs = dict(x=torch.randn(3, 128), granularity="per_token")
    assert ask(adapter.supports, spec.SPEC, kwargs, simulate(arch)) == QUANTIZE_FP8_REASON


def test_the_reason_is_not_hypothetical(gfx950):
    # Row 0's groups have amax 448: scale 1 both ways, the same codes. Row 1's have amax 3, and
    # 3 * fl(1/448) is an ulp above 3 / 448. Row 2 is zero: scale 0 in aiter, floored in the spec.
    x = torch.zeros(3, 256)
    x[0, 7], x[0, 200], x[1, 9], x[1, 130] = 448.0, -448.0, 3.0, 3.0
    x[:2, 100] = 0.5
    for granularity in ("per_token", "per_group"):
        got_q, got_scale = adapter.quantize_fp8(x, granularity, 128, False, "e4m3fn")
        want_q, want_scale = spec.SPEC.reference(x, granularity, 128, False, "e4m3fn")
        assert torch.equal(got_scale[0], want_scale[0])
        assert torch.equal(got_q[0].view(torch.uint8), want_q[0].view(torch.uint8))
        assert got_scale[1, 0].item() != want_scale[1, 0].item()
        assert got_scale[2, 0].item() == 0.0 < want_scale[2, 0].item()
