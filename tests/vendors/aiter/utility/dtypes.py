"""Fake aiter.utility.dtypes: fp8 is e4m3fnuz on gfx942 and e4m3fn on gfx950 (defaultDtypes), fixed at
import as aiter's is."""
import torch

from ..jit.utils.chip_info import get_gfx_runtime

fp8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}.get(get_gfx_runtime(), torch.uint8)
fp4x2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
fp8_e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
fp16 = torch.float16
bf16 = torch.bfloat16
fp32 = torch.float32
i32 = torch.int32
i8 = torch.int8
u8 = torch.uint8
