"""Fake aiter (amd-aiter at ROCm/aiter e4048607, 0.1.21.dev46): its layout, the shipped signatures and
host checks of the entry points kernelmux calls, their kernels' layouts asserted, the math written here.
Compiled entry points are torch.ops.aiter.* behind (*args, **kwargs) forwarders, as in aiter."""

from .jit import core as core
from .utility import dtypes as dtypes
from .ops.enum import *  # noqa: F401,F403
from .ops.quant import *  # noqa: F401,F403
from .ops.gemm_op_a8w8 import *  # noqa: F401,F403
from .ops.gemm_op_a4w4 import *  # noqa: F401,F403
from .ops.topk import *  # noqa: F401,F403
from .ops.mha import *  # noqa: F401,F403
from . import mla  # noqa: F401
