"""Fake vllm-xpu-kernels 0.1.16.2: the package root, which (as the real one) imports only the flash-attention
wrapper and with it the _vllm_fa2_C extension; _C, _moe_C and _xpu_C register their ops when imported."""

from .flash_attn_interface import flash_attn_varlen_func  # noqa: F401
