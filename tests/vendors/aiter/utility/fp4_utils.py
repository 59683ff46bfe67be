"""Fake aiter.utility.fp4_utils: e8m0_shuffle (aiter's shuffle_scale) and dynamic_mxfp4_quant with its
'even' scale (amax + 2^21 ulps masked, floor(log2) - 2, clamped to +-127) and elements x * 2^-e rounded
to nearest even e2m1, saturating at 6."""
import torch

from . import dtypes

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e8m0_shuffle(scale):
    from ..ops.shuffle import shuffle_scale

    return shuffle_scale(scale)


def _e2m1_codes(values):
    """Nearest e2m1 code of each fp32 value, ties to the even code, saturating at +-6."""
    grid = torch.tensor(E2M1, dtype=torch.float64)
    magnitude = values.abs().double().clamp(max=6.0)
    distance = (magnitude[..., None] - grid).abs()
    best = distance.min(dim=-1, keepdim=True).values
    ties = distance == best
    code = torch.where(ties & (torch.arange(8) % 2 == 0), torch.arange(8), 99).amin(dim=-1)
    code = torch.where(ties.sum(-1) > 1, code, distance.argmin(dim=-1))
    return (code + 8 * torch.signbit(values).long()).to(torch.uint8)


def dynamic_mxfp4_quant(x, scaling_mode="even", shuffle=False):
    if shuffle:
        raise NotImplementedError("fake: the shuffled scale store is not modelled")
    rows, cols = x.shape
    if (cols // 2) % 2:
        raise AssertionError("(N // 2) % 2 == 0")
    blocks = x.float().reshape(rows, cols // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    rounded = ((amax.view(torch.int32) + 0x200000).view(torch.uint32) & 0xFF800000).view(torch.float32)
    exponent = (torch.log2(rounded).floor() - 2).clamp(-127, 127)
    codes = _e2m1_codes(blocks * torch.exp2(-exponent)[..., None]).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(dtypes.fp4x2), (exponent + 127).to(torch.uint8).view(dtypes.fp8_e8m0)
