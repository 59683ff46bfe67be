"""Fake block-scaled FP8 GEMMs of flashinfer.gemm (0.6.14): fp8_blockscale_gemm_sm90 and
gemm_fp8_nt_groupwise with the shipped signatures and checks (gemm_base.py and the C++ bindings), reading
their operands and scales from raw memory as the kernels do (they take pointers, not strides), and the
block-scaled product written here in fp64."""
import torch

SIMULATED_CAPABILITY = (9, 0)  # what get_compute_capability(device) answers; tests set another
CALLS = []  # (function name, M, N, K, extra) per call that reached a kernel
BLOCK = 128
TMA_BYTES = 16


def _ceil_div(x, y):
    return (x + y - 1) // y


def _raw(t, shape, strides):
    """What a kernel given ``t.data_ptr()`` reads as ``shape`` with ``strides`` (elements); reading past
    the allocation fails here as it would fault there."""
    return t.as_strided(shape, strides, t.storage_offset())


def _check_tma_address(t, name):
    if t.data_ptr() % TMA_BYTES:
        raise RuntimeError(f"CUDA error: misaligned address (TMA descriptor of {name})")


def _blockwise(a, b, scale_a, scale_b, gran_m, gran_n, gran_k):
    """sum over K groups g of (a_g @ b_g.T) * sa[m // gran_m, g] * sb[n // gran_n, g], in fp64."""
    m, k = a.shape
    n = b.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float64)
    sa = scale_a.double().cpu()[torch.arange(m) // gran_m]
    sb = scale_b.double().cpu()[torch.arange(n) // gran_n]
    for g in range(_ceil_div(k, gran_k)):
        lo, hi = g * gran_k, min(k, (g + 1) * gran_k)
        acc += (a[:, lo:hi].double().cpu() @ b[:, lo:hi].double().cpu().T) * sa[:, g, None] * sb[None, :, g]
    return acc


def fp8_blockscale_gemm_sm90(input, weight, input_scale=None, weight_scale=None, out=None, out_dtype=None):
    if SIMULATED_CAPABILITY != (9, 0):
        raise ValueError("fp8_blockscale_gemm_sm90 is only supported on SM90 (Hopper) architecture.")
    if input.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"Input must be 2D (M, K), got shape {input.shape}")
    m, k = input.shape
    n, k_weight = weight.shape
    if k_weight != k:
        raise ValueError(f"K dimension mismatch: input has K={k}, weight has K={k_weight}")
    if k % BLOCK:
        raise ValueError(f"K dimension must be divisible by block size ({BLOCK}), got K={k}")
    if n % 64:
        raise ValueError(f"N dimension must be divisible by 64, got N={n}")
    if input.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise NotImplementedError("fake flashinfer: only the FP8 + FP8 (W8A8) path is modelled")
    if input_scale is None or input_scale.dtype != torch.float32 or input_scale.device != input.device:
        raise ValueError("input_scale is required when input is FP8 (float32, on input's device)")
    if weight_scale is None or weight_scale.dtype != torch.float32:
        raise ValueError("weight_scale is required when weight is FP8 (float32)")
    if tuple(weight_scale.shape) not in ((n, k // BLOCK), (_ceil_div(n, BLOCK), k // BLOCK)):
        raise ValueError(f"weight_scale shape mismatch, got {weight_scale.shape}")
    if out is not None:
        if tuple(out.shape) != (m, n) or out.device != input.device:
            raise ValueError(f"Output shape mismatch. Expected ({m}, {n}), got {out.shape}")
        if out.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Output dtype must be torch.bfloat16 or torch.float16, got {out.dtype}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"Output dtype mismatch. Expected {out_dtype}, got {out.dtype}")
    else:
        out_dtype = out_dtype or torch.bfloat16
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Output dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
        out = torch.empty(m, n, dtype=out_dtype, device=input.device)
    # The binding (fp8_blockscale_gemm_sm90_binding.cu): K, N multiples of 16, then raw pointers with
    # leading dimensions K (input, weight) and N (output); strides are never read.
    if k % 16 or n % 16:
        raise RuntimeError("N must be a multiple of 16")
    if m == 0:
        return out  # fp8_gemm_run returns at shape_m == 0
    _check_tma_address(input, "input")
    _check_tma_address(weight, "weight")
    groups, rows = k // BLOCK, _ceil_div(m, 4) * 4
    a = _raw(input, (m, k), (k, 1))
    b = _raw(weight, (n, k), (k, 1))
    # The activation scales through a column-major TMA descriptor of M rounded up to 4 rows
    # (make_2d_tma_scales_a_desc); the weight scales as [ceil(N/128), K/128] rows (fp8_gemm_impl.cuh).
    scale_a = _raw(input_scale, (groups, rows), (rows, 1))[:, :m].T
    scale_b = _raw(weight_scale, (_ceil_div(n, BLOCK), groups), (groups, 1))
    CALLS.append(("fp8_blockscale_gemm_sm90", m, n, k, None))
    result = _blockwise(a, b, scale_a, scale_b, 1, BLOCK, BLOCK).to(torch.bfloat16)
    # "Output is always BF16": the W8A8 path writes bf16 through the output pointer whatever its dtype.
    _raw(out, (m, n), (n, 1)).copy_(result.view(out.dtype))
    return out


_CUTLASS_CAPABILITIES = ((10, 0), (10, 3), (12, 0), (12, 1))


def gemm_fp8_nt_groupwise(a, b, a_scale, b_scale, scale_major_mode=None, mma_sm=1,
                          scale_granularity_mnk=(1, 128, 128), out=None, out_dtype=None, backend="cutlass"):
    # @backend_requirement: the common check, then the backend's own requirement and capabilities.
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"Shape mismatch. a.shape = {a.shape}, b.shape = {b.shape}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"Shape mismatch. a.shape[1] = {a.shape[1]}, b.shape[1] = {b.shape[1]}")
    dtype = (out_dtype or torch.bfloat16) if out is None else out.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"Unsupported output dtype: {dtype}.")
    if backend != "cutlass":
        raise NotImplementedError(f"fake flashinfer: backend {backend!r} is not modelled")
    if SIMULATED_CAPABILITY not in _CUTLASS_CAPABILITIES:
        raise ValueError(f"gemm_fp8_nt_groupwise: backend cutlass does not support {SIMULATED_CAPABILITY}")
    if scale_major_mode is None:
        raise ValueError("scale_major_mode is required in CUTLASS")
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=a.device)
    # CutlassGemmGroupwiseScaledSM100: dispatches on these, then hands raw pointers to CUTLASS.
    if scale_major_mode not in ("K", "MN"):
        raise RuntimeError("Unsupported Scale Major Mode")
    if mma_sm not in (1, 2):
        raise RuntimeError("Unsupported MMA SM")
    if a.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype != a.dtype:
        raise RuntimeError(f"Unsupported input dtype {a.dtype}")
    gran_m, gran_n, gran_k = scale_granularity_mnk
    if (gran_m, gran_n, gran_k) not in ((1, 128, 128), (128, 128, 128)):
        raise RuntimeError("Unsupported scale granularity")
    if m % 4:
        raise RuntimeError("fake flashinfer: m must be padded to a multiple of 4 (the kernel's requirement)")
    for t, name in ((a, "a"), (b, "b"), (out, "out")):
        _check_tma_address(t, name)
    sm_rows, sn_rows, groups = _ceil_div(m, gran_m), _ceil_div(n, gran_n), _ceil_div(k, gran_k)
    # CUTLASS's Sm100BlockwiseScaleConfig layouts (blockwise_scale_layout.hpp), packed.
    if scale_major_mode == "K":
        sfa = _raw(a_scale, (sm_rows, groups), (groups, 1))
        sfb = _raw(b_scale, (sn_rows, groups), (groups, 1))
    else:
        sfa = _raw(a_scale, (sm_rows, groups), (1, sm_rows))
        sfb = _raw(b_scale, (sn_rows, groups), (1, sn_rows))
    CALLS.append(("gemm_fp8_nt_groupwise", m, n, k, dict(scale_major_mode=scale_major_mode, mma_sm=mma_sm)))
    result = _blockwise(_raw(a, (m, k), (k, 1)), _raw(b, (n, k), (k, 1)), sfa, sfb, gran_m, gran_n, gran_k)
    _raw(out, (m, n), (n, 1)).copy_(result.to(out.dtype))
    return out
