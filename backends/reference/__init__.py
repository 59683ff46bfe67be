"""The reference backend: every spec's pure-torch reference, registered so it can be chosen by name."""

from __future__ import annotations

from kernelmux.specs import ALL_SPECS
from kernelmux.registry import Backend, Implementation, hookimpl


@hookimpl
def kernelmux_implementations() -> list[Implementation]:
    return [
        Implementation(
            op=spec.name,
            backend=Backend.REFERENCE,
            fn=spec.reference,
            spec_version=spec.version,
            priority=-1000,
            description="the spec's pure-torch reference (fp32 math); the fallback",
        )
        for spec in ALL_SPECS
    ]
