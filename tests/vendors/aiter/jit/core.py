"""Fake aiter.jit.core: compile_ops, which in aiter JIT-builds a pybind module and wraps the Python
stub with torch_compile_guard(calling_func_=stub); here the stub's body is the fake kernel."""
from .utils.torch_guard import torch_compile_guard


def compile_ops(_md_name, fc_name=None, gen_func=None, gen_fake=None, ffi_type="pybind", develop=False):
    def decorator(func):
        return torch_compile_guard(device="cuda", gen_fake=gen_fake, calling_func_=func)(func)

    return decorator
