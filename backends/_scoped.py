"""Launch settings that sweeps and tests change for the length of a with-block: a kernel's plan or
launch configuration, which of two kernels runs, a switch that forces a code path. One mechanism
for every backend: a default, the value in force (``current``), and ``override(value)``, which
checks the value before it takes effect and restores the previous one on the way out, nested or
not. Not thread-safe by design: production calls never set one, and sweeps and tests run one
call at a time."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Generic, Iterator, Optional, TypeVar

Value = TypeVar("Value")


def _no_problem(_value: object) -> Optional[str]:
    return None


class ScopedSetting(Generic[Value]):
    """``current`` is ``default`` unless an ``override`` is active; ``problem(value)`` says what is
    wrong with a value (None when nothing is), and ``name`` (the public function that overrides
    it) leads the ValueError raised for it."""

    def __init__(self, name: str, default: Value,
                 problem: Callable[[Value], Optional[str]] = _no_problem) -> None:
        self.name = name
        self.default = default
        self._problem = problem
        self._value = default

    @property
    def current(self) -> Value:
        return self._value

    @contextlib.contextmanager
    def override(self, value: Value) -> Iterator[Value]:
        """Within the block, ``current`` is ``value``."""
        problem = self._problem(value)
        if problem is not None:
            raise ValueError(f"{self.name}: {problem}")
        previous, self._value = self._value, value
        try:
            yield value
        finally:
            self._value = previous


class PlanSetting(ScopedSetting[Value]):
    """A kernel family's launch plan, a frozen dataclass: ``override_fields(**fields)`` runs the
    block with the default's ``fields`` replaced (an unknown field is a TypeError)."""

    def override_fields(self, **fields) -> contextlib.AbstractContextManager[Value]:
        return self.override(dataclasses.replace(self.default, **fields))
