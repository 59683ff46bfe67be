"""A cuda kernel's launch plan: its default, and an override scoped to a with-block (tests and the
perf/diag sweeps), checked when it is set. One of these per kernel family."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable, Generic, Iterator, Optional, TypeVar

Plan = TypeVar("Plan")


class PlanOverride(Generic[Plan]):
    """``current`` is ``default`` unless ``override(**fields)`` is active; ``problem(plan)`` says
    what is wrong with a plan (None when nothing is)."""

    def __init__(self, default: Plan, problem: Callable[[Plan], Optional[str]]) -> None:
        self.default = default
        self._problem = problem
        self._active: Optional[Plan] = None

    @property
    def current(self) -> Plan:
        return self._active if self._active is not None else self.default

    @contextlib.contextmanager
    def override(self, **fields) -> Iterator[None]:
        """Within the block, calls launch with the default's ``fields`` replaced."""
        plan = replace(self.default, **fields)
        problem = self._problem(plan)
        if problem is not None:
            raise ValueError(f"override_plan: {problem}")
        previous, self._active = self._active, plan
        try:
            yield
        finally:
            self._active = previous
