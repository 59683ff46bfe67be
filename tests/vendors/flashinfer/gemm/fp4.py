"""Fake flashinfer.gemm's mm_fp4 (0.6.14, gemm_base.py): the shipped signature, the checks of
_check_mm_fp4_problem_size, the backend requirements and fp4_gemm_cutlass.cu, scales read through the
128x4 swizzle by the offset formula of get_sf_out_offset_128x4 (quantization_utils.cuh), written here
independently; the product of the dequantized operands in fp64, times alpha, rounded once."""
import torch

CALLS = []
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=torch.float64)


def _round_up(x, m):
    return (x + m - 1) // m * m


def unswizzle_128x4(swizzled, rows, cols):
    """[round_up(rows, 128), round_up(cols, 4)] swizzled bytes -> [rows, cols] linear, by the offset of
    each (row, col): m_tile * (col_tiles * 512) + k_tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4."""
    flat = swizzled.contiguous().view(torch.uint8).reshape(-1)
    col_tiles = _round_up(cols, 4) // 4
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    offset = ((r // 128) * col_tiles * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4)
    return flat[offset]


def _dequant(packed, scale_bytes, block, nvfp4):
    rows, half = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(rows, 2 * half).long()
    values = _E2M1[codes].view(rows, -1, block)
    if nvfp4:
        scales = scale_bytes.view(torch.float8_e4m3fn).double()
    else:
        scales = torch.pow(2.0, scale_bytes.double() - 127.0)
        scales = torch.where(scale_bytes == 255, torch.full_like(scales, float("nan")), scales)
    return (values * scales[..., None]).view(rows, 2 * half)


def mm_fp4(a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None, block_size=16,
           use_8x4_sf_layout=False, backend="auto", use_nvfp4=True, enable_pdl=True):
    CALLS.append(dict(backend=backend, block_size=block_size, use_nvfp4=use_nvfp4, m=a.shape[0]))
    # _check_mm_fp4_problem_size
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"mm_fp4 accepts 2d tensors, got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError("K dimension mismatch in mm_fp4")
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise ValueError("a and b must have float4_e2m1fn_x2 packed into uint8")
    if a_descale.dtype not in (torch.float8_e4m3fn, torch.uint8) or b_descale.dtype not in (
            torch.float8_e4m3fn, torch.uint8):
        raise ValueError("a_descale and b_descale must have float8_e4m3fnx2 packed into uint8")
    if alpha is not None and (alpha.dtype != torch.float or alpha.numel() != 1):
        raise ValueError("alpha must be a float scalar tensor")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"Unsupported output dtype: {out_dtype}")
    if use_nvfp4 and block_size != 16:
        raise ValueError("nvfp4 only supports block_size = 16.")
    if not use_nvfp4 and block_size != 32:
        raise ValueError("mxfp4 only supports block_size = 32.")
    if backend not in ("auto", "cudnn") and not use_nvfp4:
        raise ValueError("Only cudnn and auto FP4 GEMM supports mxfp4 quantization.")
    m, n, k = a.shape[0], b.shape[1], 2 * a.shape[1]
    # fp4_gemm_cutlass.cu: CHECK_INPUT (contiguous) on what the runner passes, a and b.T, the scales
    # a_descale and b_descale.T; k and n multiples of 32.
    for name, t in (("mat1", a), ("mat2", b.T), ("mat1Scale", a_descale), ("mat2Scale", b_descale.T)):
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    if k % 32 or n % 32:
        raise RuntimeError(f"Expected k and n to be divisible by 32, got k {k}, n {n}")
    cols = k // block_size
    for name, t, rows in (("a_descale", a_descale, m), ("b_descale", b_descale.T, n)):
        if tuple(t.shape) != (_round_up(rows, 128), _round_up(cols, 4)):
            raise RuntimeError(f"{name}: expected the 128x4 swizzled shape, got {tuple(t.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype)
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        raise RuntimeError("out shape/dtype")
    deq_a = _dequant(a, unswizzle_128x4(a_descale, m, cols), block_size, use_nvfp4)
    deq_b = _dequant(b.T, unswizzle_128x4(b_descale.T, n, cols), block_size, use_nvfp4)
    product = deq_a @ deq_b.T
    if alpha is not None:
        product = product * alpha.double().reshape(())
    out.copy_(product.to(out_dtype))
    return out
