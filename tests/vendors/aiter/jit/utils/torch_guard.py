"""Fake aiter.jit.utils.torch_guard: torch_compile_guard defines ``torch.ops.aiter.<name>`` with the schema
torch infers from the function and returns a ``(*args, **kwargs)`` forwarder to it, as aiter's does, so
keywords are checked against the schema. Each import of the fake replaces the previous one's ops."""
import sys
import types

import torch

_STATE = "_kernelmux_fake_aiter_ops"  # survives the test harness dropping aiter.* from sys.modules
_state = sys.modules.get(_STATE)
if _state is None:
    _state = sys.modules[_STATE] = types.ModuleType(_STATE)
if getattr(_state, "library", None) is not None:
    _state.library._destroy()
LIBRARY = _state.library = torch.library.Library("aiter", "FRAGMENT")


def torch_compile_guard(mutates_args="unknown", device="cpu", calling_func_=None, gen_fake=None):
    def decorator(func):
        calling = calling_func_ if calling_func_ is not None else func
        name = calling.__name__
        LIBRARY.define(name + torch.library.infer_schema(calling, mutates_args=mutates_args))
        LIBRARY.impl(name, func, dispatch_key="CPU")

        def wrapper_custom(*args, **kwargs):
            return getattr(torch.ops.aiter, name)(*args, **kwargs)

        return wrapper_custom

    return decorator
