"""The reference backend: every spec's pure-torch reference, registered so it can be chosen by name.
Unlike the other backends it has no Entry table and no entry modules: its implementation of an op
is the spec's own ``reference`` function, so it registers one record per spec in ``ALL_SPECS``."""

from __future__ import annotations

from kernelmux.registry import Backend, Implementation, hookimpl
from kernelmux.specs import ALL_SPECS


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
