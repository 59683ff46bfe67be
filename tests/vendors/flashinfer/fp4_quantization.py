"""Fake flashinfer.fp4_quantization (0.6.14): fp4_quantize with the shipped signature, the checks of
fp4Quantize.cpp and the arithmetic of cvt_warp_fp16_to_fp4 (quantization_utils.cuh), written here
independently in fp32 steps: reciprocals as correctly rounded ones (the kernel's rcp.approx may differ
in the last bit), flush-to-zero (-use_fast_math), __hmax dropping NaN, e2m1 by round-half-even with the
sign kept (cvt.rn.satfinite.e2m1x2.f32, NaN taken to the largest magnitude here), and the e8m0 scale
rounded up and saturated (__nv_cvt_float_to_e8m0 with cudaRoundPosInf)."""
import torch

CALLS = []
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_TINY = 2.0 ** -126  # the smallest normal fp32: below it -use_fast_math flushes to zero
_RCP6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)


def _ftz(v):
    return torch.where(v.abs() < _TINY, torch.copysign(torch.zeros_like(v), v), v)  # sign kept


def _e2m1(v):
    """Codes of fp32 v: nearest of the 8 magnitudes, ties to the even code, saturating; sign bit kept."""
    magnitude = torch.nan_to_num(v.abs(), nan=6.0)
    distance = (magnitude[..., None] - _E2M1).abs()
    best = distance.min(dim=-1, keepdim=True).values
    tied = distance == best
    codes = torch.arange(8)
    # Of the nearest magnitudes prefer the even code (round half to even), else the only one.
    even = tied & (codes % 2 == 0)
    code = torch.where(even.any(-1), (even * codes).sum(-1), (tied * codes).sum(-1))
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def _block_amax(blocks):
    # __hmax returns the other operand when one is NaN: a block's max ignores NaN (unless all are).
    finite_or_inf = torch.where(torch.isnan(blocks), torch.full_like(blocks, -1.0), blocks.abs())
    amax = finite_or_inf.amax(dim=-1)
    return torch.where(amax < 0, torch.full_like(amax, float("nan")), amax)


def _e8m0_ceil(d):
    """__nv_cvt_float_to_e8m0(d, satfinite, round up) for d >= 0: 2^ceil(log2 d) as a code."""
    mantissa, exponent = torch.frexp(d)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    code = (e + 127).clamp(0, 254)
    code = torch.where(d == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isinf(d), torch.full_like(code, 254), code)
    return torch.where(torch.isnan(d), torch.full_like(code, 255), code).to(torch.uint8)


def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                 is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None, backend="cuda"):
    CALLS.append(dict(sf_vec_size=sf_vec_size, ue8m0=sf_use_ue8m0, swizzled=is_sf_swizzled_layout,
                      shape=tuple(input.shape)))
    if sf_vec_size not in (16, 32):
        raise NotImplementedError("sf_vec_size can only be 16 or 32")
    if backend != "cuda":
        raise ValueError(f"Unknown backend: {backend}")
    if input.stride(-2) == 1:
        raise AssertionError("this fake does not model column-major input (fp4_quantize transposes it)")
    if not input.is_contiguous():
        raise RuntimeError("self must be contiguous")  # CHECK_CONTIGUOUS
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError("fp4_quantize only supports input tensor with dtypes fp16/bf16/e4m3.")
    if sf_use_ue8m0 and sf_vec_size != 32:
        raise RuntimeError("sfVecSize can only be 32, when sfUseUE8M0 is true")
    if not sf_use_ue8m0:
        if global_scale is None or global_scale.dtype != torch.float32:
            raise RuntimeError("globalScale is required when sfUseUE8M0 is false")
        if sf_vec_size != 16:
            raise RuntimeError("sfVecSize can only be 16, when sfUseUE8M0 is false")
    if is_sf_swizzled_layout:
        raise AssertionError("this fake writes the linear layout only (kernelmux asks for it)")
    rows, cols = input.shape
    if cols % sf_vec_size:
        raise AssertionError("k % sf_vec_size")
    blocks = input.float().view(rows, cols // sf_vec_size, sf_vec_size)
    amax = _block_amax(blocks)
    if sf_use_ue8m0:
        d = _ftz(amax * _RCP6)
        sf = _e8m0_ceil(d)
        power = torch.ldexp(torch.ones_like(d), 127 - sf.to(torch.int32))  # exp2f_rcp
        scale = torch.where(sf == 0, torch.ones_like(d), power)
        scale = torch.where(d != 0, scale, torch.zeros_like(d))
    else:
        gs = global_scale.float().reshape(())
        value = _ftz(gs * _ftz(amax * _RCP6))
        sf_value = value.clamp_max(448.0).to(torch.float8_e4m3fn)  # __NV_SATFINITE
        sf = sf_value.view(torch.uint8)
        scale = torch.where(amax != 0, 1.0 / (sf_value.float() * (1.0 / gs)), torch.zeros_like(amax))
    codes = _e2m1(_ftz(blocks * scale[..., None])).view(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sf.reshape(rows, cols // sf_vec_size)
