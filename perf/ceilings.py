"""Ceilings for the roofline, measured in the same run as the rows they judge: memory bandwidth
(a large copy, bytes read plus written) and dense matrix rates (bf16, fp8 where the GPU has it,
fp32 on CPUs), with the datasheet values of the GPUs we run on beside them."""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

from kernelmux.perf.timing import copy_bandwidth_gbps

# Dense (no sparsity) tensor-core peaks and HBM bandwidth, SXM parts, from NVIDIA's datasheets.
DATASHEETS: dict[str, dict[str, float]] = {
    "H100": {"memory_gbps": 3350.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0},
    "H200": {"memory_gbps": 4800.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0},
    "B200": {"memory_gbps": 8000.0, "bf16_tflops": 2250.0, "fp8_tflops": 4500.0},
}


def datasheet(device_name: str) -> Optional[dict[str, float]]:
    for part, values in DATASHEETS.items():
        if part in device_name:
            return dict(values)
    return None


def _cuda_seconds(fn, trials: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _cpu_seconds(fn, trials: int) -> float:
    fn()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_fp8_tflops(n: int) -> Optional[float]:
    """torch._scaled_mm on e4m3 operands (per-tensor scales, bf16 out); None where the GPU has
    no fp8 matrix instructions (before sm_89)."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    def matmul():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    seconds = _cuda_seconds(matmul, 10)
    return 2 * n**3 / seconds / 1e12


def measure(device: str, quick: bool = False) -> dict[str, Any]:
    """``{"memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops"}`` for ``device`` ("cuda" or
    "cpu"); a rate the device has no instruction for is None. ``quick`` uses smaller problems
    (less accurate, for --quick runs)."""
    if device == "cuda":
        n = 4096 if quick else 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        bf16 = 2 * n**3 / _cuda_seconds(lambda: a @ b, 10) / 1e12
        af, bf = a.float(), b.float()
        fp32 = 2 * n**3 / _cuda_seconds(lambda: af @ bf, 5) / 1e12
        return {
            "memory_gbps": copy_bandwidth_gbps(512 << 20 if quick else 2 << 30),
            "bf16_tflops": bf16,
            "fp8_tflops": _cuda_fp8_tflops(n),
            "fp32_tflops": fp32,
        }
    # CPU: a copy well past the last-level cache, and square matmuls big enough to be compute-bound.
    nbytes = (128 if quick else 512) << 20
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    memory = 2 * nbytes / _cpu_seconds(lambda: dst.copy_(src), 5) / 1e9
    n = 1024 if quick else 2048
    rates = {}
    for name, dtype in (("bf16_tflops", torch.bfloat16), ("fp32_tflops", torch.float32)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rates[name] = 2 * n**3 / _cpu_seconds(lambda: a @ b, 3) / 1e12
    return {"memory_gbps": memory, "fp8_tflops": None, **rates}
