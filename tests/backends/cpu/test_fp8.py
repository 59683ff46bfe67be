"""backends/cpu/_fp8.py: the exact fp8 -> fp16/bf16 route, code by code."""

from __future__ import annotations

import pytest
import torch

from kernelmux.backends.cpu import _fp8

FP8 = torch.float8_e4m3fn
ALL_CODES = torch.arange(256, dtype=torch.uint8).view(FP8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_route_is_exact_for_every_code(dtype):
    codes = ALL_CODES.view(16, 16)  # 2-D: the route keeps the shape
    out = torch.full((256,), 7.0, dtype=dtype)
    got = _fp8.fp8_to_half_scaled(codes, out, torch.empty(256, dtype=torch.int16))
    assert got.shape == codes.shape and got.dtype == dtype
    want = codes.float() / _fp8.FP8_ROUTE_SCALE  # torch's own conversion, exact in fp32
    nan = want.isnan()
    assert nan.sum() == 2  # 0x7f and 0xff
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.float()[~nan], want[~nan])
    # Signed zeros survive too (0x80 is -0.0).
    assert torch.signbit(got.view(-1)[0x80]) and not torch.signbit(got.view(-1)[0x00])


def test_fp8_route_restores_nan_only_when_present():
    codes = torch.tensor([0x38, 0xB8, 0x7E, 0xFE], dtype=torch.uint8).view(FP8)  # 1, -1, 448, -448
    bits = torch.empty(4, dtype=torch.int16)
    out = _fp8.fp8_to_half_scaled(codes, torch.empty(4, dtype=torch.bfloat16), bits)
    assert out.float().mul(_fp8.FP8_ROUTE_SCALE).tolist() == [1.0, -1.0, 448.0, -448.0]
    empty = _fp8.fp8_to_half_scaled(codes[:0], torch.empty(0, dtype=torch.float16), bits[:0])
    assert empty.shape == (0,)


def test_fnuz_route_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fnuz).view(16, 16)
    scratch = torch.full((300,), 7, dtype=torch.int16)  # larger than needed: the first 256 are used
    got = _fp8.fp8_as_half(codes, scratch)
    assert got.shape == codes.shape and got.dtype == torch.float16
    want = codes.float() / _fp8.ROUTE_SCALES[torch.float8_e4m3fnuz]
    nan = want.isnan()
    assert nan.sum() == 1 and bool(nan.view(-1)[0x80])  # fnuz's only NaN; 0x7f and 0xff are +-240
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.float()[~nan], want[~nan])
    assert scratch[256:].tolist() == [7] * 44


def test_fnuz_route_restores_nan_only_when_present():
    codes = torch.tensor([0x40, 0xC0, 0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    half = _fp8.fp8_as_half(codes, torch.empty(4, dtype=torch.int16))
    assert half.float().mul(128.0).tolist() == [1.0, -1.0, 240.0, -240.0]
