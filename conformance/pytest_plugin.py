"""The conformance kit as a pytest fixture, for a plugin's own test suite (loaded through the
``pytest11`` entry point once kernelmux is installed; it imports kernelmux only when used):

    def test_my_backend_conforms(kernelmux_conformance):
        kernelmux_conformance("my_backend")            # every op it registers
        kernelmux_conformance("my_backend", ["mla_decode"], cases=["small_fp8"])
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


def assert_conforms(backend: str, ops: Any = None, **options: Any) -> Any:
    """``kernelmux.conformance.check(backend, ops, **options)``'s report; an AssertionError listing
    every failure when any failed."""
    from kernelmux.conformance import check

    report = check(backend, ops, **options)
    if report.failures:
        raise AssertionError(f"{report.summary()}\n{report.failure_table()}")
    return report


@pytest.fixture
def kernelmux_conformance() -> Callable[..., Any]:
    """``assert_conforms``: check a backend against the specs, failing the test on any failure."""
    return assert_conforms
