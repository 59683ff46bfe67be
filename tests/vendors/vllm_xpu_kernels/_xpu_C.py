"""Fake vllm-xpu-kernels 0.1.16.2: the _xpu_C extension, registering cutlass_grouped_gemm_interface (its Xe2
path, 16-bit experts), fp8_gemm and fp4_gemm with the shipped schemas, their host checks, and CPU math that
follows oneDNN's scale branches (fp8_gemm_w8a8.h, fp4_gemm_w4a4.h): a scale in another layout is misapplied."""

import torch

from vllm_xpu_kernels._library import define

CALLS = []  # (op name, dict of what reached the kernel), one per call

FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK


def cutlass_grouped_gemm_interface(ptr_A, ptr_A_scale, ptr_B, ptr_B_scale, ptr_bias, ptr_D, rows_per_expert, N, K,
                                   num_experts):
    if ptr_B.dtype not in (torch.bfloat16, torch.float16) or ptr_B_scale is not None:
        raise NotImplementedError("fake vllm_xpu_kernels: only 16-bit experts are modelled")
    _check(N % 8 == 0, "N must be divisible by 8")
    _check(ptr_A.dim() == 2, "ptr_A must be 2D [Total_M, K]")
    _check(ptr_B.dim() == 3, "ptr_B must be 3D [num_experts, K, N]")
    _check(ptr_D.dim() == 2, "ptr_D must be 2D [Total_M, N]")
    _check(ptr_A.is_contiguous(), "ptr_A must be contiguous")
    _check(ptr_B.is_contiguous(), "ptr_B must be contiguous")
    _check(ptr_D.is_contiguous(), "ptr_D must be contiguous")
    _check(ptr_B.shape[0] == num_experts, "ptr_B.size(0) must match num_experts")
    _check(ptr_A.shape[0] == ptr_D.shape[0], "ptr_A.size(0) must match ptr_D.size(0)")
    _check(ptr_A.shape[1] == ptr_B.shape[1] == K, "ptr_A.size(1) must match ptr_B.size(1)")
    _check(ptr_B.shape[2] == ptr_D.shape[1] == N, "ptr_B.size(2) must match ptr_D.size(1)")
    assert ptr_A.dtype == ptr_B.dtype == ptr_D.dtype, "fake vllm_xpu_kernels: W16A16 wants one dtype"
    assert ptr_bias is None, "fake vllm_xpu_kernels: biases are not modelled"
    counts = rows_per_expert.tolist()
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        ptr_D[rows] = (ptr_A[rows].float() @ ptr_B[expert].float()).to(ptr_D.dtype)
        start += count
    CALLS.append(("cutlass_grouped_gemm_interface", dict(N=N, K=K, rows=start)))
    return ptr_D


def _output(A, B, out_dtype):
    # check_and_create_output_tensor: [M, N] laid out from A's strides; fp16 when out_dtype is None.
    _check(A.dim() in (2, 3), "OneDNN Matmul only support 2D and 3D inputs!\n")
    _check(B.dim() in (2, 3), "OneDNN Matmul only support 2D and 3D weights!\n")
    assert A.dim() == 2 and B.dim() == 2, "fake vllm_xpu_kernels: batched matmuls are not modelled"
    return torch.empty((A.shape[0], B.shape[-1]), dtype=out_dtype or torch.float16)


def _leading(A, B, what):
    # lda is A's row stride with unit columns; ldb one of B's strides with the other 1 (NT or NN).
    assert A.stride(-1) == 1, f"fake vllm_xpu_kernels: {what} reads A with a row stride and unit columns"
    assert B.stride(-1) == 1 or B.stride(-2) == 1, f"fake vllm_xpu_kernels: {what} needs B with one unit stride"


def fp8_gemm(A, B, out_dtype, A_scale_, B_scale_, bias_):
    for scale, what in ((A_scale_, "A_scale"), (B_scale_, "B_scale"), (bias_, "bias")):
        _check(scale is None or scale.is_contiguous(), f"{what} must be contiguous for fp8 matmul")
    result = _output(A, B, out_dtype)
    _check(A.dtype in FP8 and B.dtype in FP8 and A.dtype == B.dtype,
           "input and weight must be f8_e5m2 or f8_e4m3fn for fp8 matmul")
    _check(result.dtype in (torch.float16, torch.bfloat16), "output must be float16 or bfloat16 for fp8 matmul")
    _leading(A, B, "fp8_gemm")
    m, k = A.shape
    n = B.shape[1]
    sa = A_scale_ if A_scale_ is not None else torch.ones(1)
    sb = B_scale_ if B_scale_ is not None else torch.ones(1)
    assert sa.dtype == sb.dtype == torch.float32, "fake vllm_xpu_kernels: fp32 scales are what is modelled"
    a, b = A.float(), B.float()  # B is the [K, N] weight, whichever of its strides is 1
    if sa.dim() == 2 and sa.shape[1] > 1:  # block: groups {1, K / sb.size(0)} and {K / sb.size(0), N / sb.size(1)}
        _check(sa.shape[1] == sb.shape[0], "Mismatch group size in input and weight.")
        group_k, group_n = k // sb.shape[0], n // sb.shape[1]
        a = a * sa.repeat_interleave(group_k, dim=1)[:, :k]
        b = b * sb.repeat_interleave(group_k, dim=0)[:k].repeat_interleave(group_n, dim=1)[:, :n]
        branch = "block"
    else:
        a = a * (sa.reshape(()) if sa.numel() == 1 else sa.reshape(m, 1))  # per tensor / per token {1, K}
        b = b * (sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, n))  # per tensor / per channel (mask 1<<1)
        branch = f"{'tensor' if sa.numel() == 1 else 'token'}x{'tensor' if sb.numel() == 1 else 'channel'}"
    out = a.double() @ b.double()
    if bias_ is not None:
        out = out + bias_.double()
    result.copy_(out.to(result.dtype))
    CALLS.append(("fp8_gemm", dict(m=m, n=n, k=k, branch=branch, nt=B.stride(-2) == 1)))
    return result


def _e2m1(packed):
    """[R, C] uint8 -> [R, 2C] fp32, element 2j from the low nibble."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return E2M1[codes.long()]


def _e8m0(codes):
    value = torch.exp2(codes.float() - 127.0)
    return torch.where(codes == 0xFF, torch.full_like(value, float("nan")), value)


def fp4_gemm(A, B, A_scale, B_scale, out_dtype, bias_):
    _check(A_scale.is_contiguous(), "A_scale must be contiguous for fp4 matmul")
    _check(B_scale.is_contiguous(), "B_scale must be contiguous for fp4 matmul")
    result = _output(A, B, out_dtype)
    fp4 = torch.float4_e2m1fn_x2
    _check(A.dtype == fp4 and B.dtype == fp4, "input and weight must be f4_e2m1x2 or f4_e2m1x2 for fp4 matmul")
    _check(result.dtype in (torch.float16, torch.bfloat16), "output must be float16 or bfloat16 for fp4 matmul")
    if A_scale.dtype != torch.float8_e8m0fnu:
        raise RuntimeError(f"Unsupported scale type for fp4 matmul: {A_scale.dtype}")
    _check(B_scale.dtype == torch.float8_e8m0fnu, "Mismatched scale data types in mxfp4 matmul: ")
    _leading(A, B, "fp4_gemm")
    assert bias_ is None, "fake vllm_xpu_kernels: fp4 biases are not modelled"
    m, k = A.shape[0], 2 * A.shape[1]
    n = B.shape[1]
    a = _e2m1(A.view(torch.uint8))  # [M, K]
    b = _e2m1(B.view(torch.uint8).t())  # the [K/2, N] weight's columns: [N, K]
    # Scale groups {1, 32} for A and {32, 1} for the weight, both tensors row-major [rows, K / 32] as
    # the vendor's test_mxfp4_gemm passes them.
    assert tuple(A_scale.shape) == (m, k // 32) and tuple(B_scale.shape) == (n, k // 32), (
        f"fake vllm_xpu_kernels: fp4_gemm scales [M, K/32] and [N, K/32], got {tuple(A_scale.shape)}, "
        f"{tuple(B_scale.shape)}")
    a = a * _e8m0(A_scale.view(torch.uint8)).repeat_interleave(32, dim=1)
    b = b * _e8m0(B_scale.view(torch.uint8)).repeat_interleave(32, dim=1)
    result.copy_((a.double() @ b.double().T).to(result.dtype))
    CALLS.append(("fp4_gemm", dict(m=m, n=n, k=k, nt=B.stride(-2) == 1)))
    return result


define("_xpu_C", "cutlass_grouped_gemm_interface(Tensor ptr_A, Tensor? ptr_A_scale, Tensor ptr_B, Tensor? "
                 "ptr_B_scale, Tensor? ptr_bias, Tensor ptr_D, Tensor rows_per_expert, int N, int K, int num_experts)"
                 " -> Tensor", cutlass_grouped_gemm_interface)
define("_xpu_C", "fp8_gemm(Tensor A, Tensor B, ScalarType? out_dtype, Tensor? A_scale_, Tensor? B_scale_, Tensor? "
                 "bias_) -> Tensor", fp8_gemm)
define("_xpu_C", "fp4_gemm(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, ScalarType? out_dtype, Tensor? bias_)"
                 " -> Tensor", fp4_gemm)
