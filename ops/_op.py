"""The public callable of one op: eager calls go straight to the engine's dispatcher; under
torch.compile the call goes through the op's torch custom op, so graphs trace without breaks."""

from __future__ import annotations

from typing import Any, Callable

import torch

from kernelmux import engine
from kernelmux.specs._spec import OpSpec

__all__ = ["Op"]

_is_compiling = torch.compiler.is_compiling


class Op:
    """``kernelmux.ops.<name>``: call it like the spec's reference.

    Attributes: ``spec`` (the contract), ``reference`` (the pure-torch math) and ``custom_op``
    (``torch.ops.kernelmux.<name>``).
    """

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.__doc__ = spec.reference.__doc__
        self.__signature__ = spec.signature
        self.__wrapped__ = spec.reference
        self.custom_op = _define_custom_op(spec)

    @property
    def reference(self) -> Callable[..., Any]:
        return self.spec.reference

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return self.custom_op(*args, **kwargs)
        return engine.current().dispatchers[self.name](*args, **kwargs)

    def __repr__(self) -> str:
        return f"<kernelmux op {self.name} v{self.spec.version}>"


def _define_custom_op(spec: OpSpec) -> Any:
    """Register ``torch.ops.kernelmux.<name>`` with the spec's schema (from the reference's
    annotations) and fake; its body dispatches through the current engine like an eager call."""
    name = spec.name

    def body(*args: Any, **kwargs: Any) -> Any:
        from kernelmux.engine import current

        return current().dispatchers[name](*args, **kwargs)

    body.__signature__ = spec.signature  # type: ignore[attr-defined]
    body.__name__ = name
    op = torch.library.custom_op(f"kernelmux::{name}", body, mutates_args=spec.mutates_args)
    op.register_fake(spec.fake)
    return torch.ops.kernelmux.__getattr__(name).default
