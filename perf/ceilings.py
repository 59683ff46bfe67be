"""Ceilings for the roofline, measured in the same run as the rows they judge and timed by that
run's ``timing.Method``: memory bandwidth (a large copy, bytes read plus written) and dense matrix
rates (bf16, fp8 where the GPU has it, fp32), with the datasheet values of the GPUs we run on."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Collection, Optional

import torch

from kernelmux.perf.timing import Method, time_calls

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


NAMES = ("memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops")


def _cuda_sizes(quick: bool) -> tuple[int, int]:
    """The GPU copy's bytes and the matmuls' n."""
    return (512 << 20, 4096) if quick else (2 << 30, 8192)


def _cuda_probes(quick: bool, names: set[str]) -> dict[str, Optional[tuple[Callable[[], Any], float]]]:
    """Each named ceiling's operation and its work (GB moved or TFLOP) per call; None where the
    GPU has no instruction for it (fp8 before sm_89). Only the named ones' operands are allocated."""
    nbytes, n = _cuda_sizes(quick)
    probes: dict[str, Optional[tuple[Callable[[], Any], float]]] = {}
    if "memory_gbps" in names:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)
        # An elementwise kernel, not copy_: inside a CUDA graph a device-to-device copy_ becomes a
        # memcpy node, which ran at 2436 GB/s on the H100 against 2973 eager and 3018 for this
        # kernel replayed (perf/diag/copy_ceiling_probe.py): not the SMs' path that rows take.
        probes["memory_gbps"] = (lambda: torch.neg(src, out=dst), 2 * nbytes / 1e9)
    if names & {"bf16_tflops", "fp8_tflops", "fp32_tflops"}:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if "bf16_tflops" in names:
        probes["bf16_tflops"] = (lambda: a @ b, 2 * n**3 / 1e12)
    if "fp8_tflops" in names:
        probes["fp8_tflops"] = None
        if torch.cuda.get_device_capability() >= (8, 9):
            # torch._scaled_mm on e4m3 operands, per-tensor scales, bf16 out.
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
            one = torch.ones((), device="cuda")
            probes["fp8_tflops"] = (
                lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                2 * n**3 / 1e12)
    if "fp32_tflops" in names:
        # fp32 at half the size: at 8192 one call takes ~20 ms, a replayed graph of 32 twenty seconds.
        af, bf = a[: n // 2, : n // 2].float(), b[: n // 2, : n // 2].float()
        probes["fp32_tflops"] = (lambda: af @ bf, 2 * (n // 2) ** 3 / 1e12)
    return probes


def _names(only: Optional[Collection[str]]) -> set[str]:
    names = set(NAMES if only is None else only)
    if not names <= set(NAMES):
        raise ValueError(f"ceilings.measure: only takes names from {NAMES}, got {sorted(names - set(NAMES))}")
    return names


def measure(device: str, quick: bool = False, only: Optional[Collection[str]] = None) -> dict[str, Any]:
    """``{"memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops"}`` for ``device`` ("cuda" or
    "cpu"), timed by the bench's default method for a ``quick`` run or not (measure_run); a rate
    the device has no instruction for is None. On a GPU each has a ``<name>_burst`` twin timed one
    call at a time. ``quick`` uses smaller problems. ``only`` (names from NAMES): just those on a
    GPU, e.g. a diagnostic that needs the copy bandwidth alone skips the matmuls' ~10 s (the CPU's
    are quick, and always all measured)."""
    return measure_run(Method.for_run(device, quick), only)[0]


def measure_run(method: Method,
                only: Optional[Collection[str]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ceilings for a bench run, each timed by ``timing.time_calls(method, ...)`` exactly as
    the run's rows are (same threads, timer, warm-up, repetitions, statistic), and how they were
    taken: ``(rates, how)``; ``rates`` as measure returns them, ``how`` the timer, the method,
    the problem sizes and, on a CPU, which route the bf16 rate took."""
    names = _names(only)
    timers: set[str] = set()

    def seconds(fn: Callable[[], Any]) -> float:
        timing, timer = time_calls(method, lambda: fn(), [{}])
        timers.add(timer)
        return timing.median_us / 1e6

    if method.device == "cuda":
        # Timed as the rows are (graph replay) so both see the same load. That matters for compute:
        # about a second of full tensor load takes an H100 to its 700 W limit and its clock from
        # 1980 to 1575-1740 MHz (perf/decisions/paged_attention.md, goals; e5bf3ce), so a matmul
        # timed one call at a time runs faster than any long compute-bound row can. Those one-call rates are kept as
        # ``<name>_burst``: a compute-bound row much shorter than the ceiling's matmuls runs
        # cooler than they did, which they show.
        probes = _cuda_probes(method.quick, names)

        def rate(probe, timer: Callable[[Callable[[], Any]], float]) -> Optional[float]:
            return None if probe is None else probe[1] / timer(probe[0])

        # Every burst first, while the GPU is cool, then the sustained replays.
        burst = {f"{name}_burst": rate(probe, lambda fn: _cuda_seconds(fn, 10))
                 for name, probe in probes.items()}
        sustained = {name: rate(probe, seconds) for name, probe in probes.items()}
        del probes
        torch.cuda.empty_cache()  # the operands and the replays' outputs, before the rows need the memory
        nbytes, n = _cuda_sizes(method.quick)
        how = {"timer": "/".join(sorted(timers)), **method.describe(), "copy_bytes": nbytes, "matmul_n": n,
               "burst": "cuda-events, one call at a time, median of 10"}
        return {**sustained, **burst}, how
    # CPU: a copy well past the last-level cache, and square matmuls big enough to be compute-bound.
    nbytes = (128 if method.quick else 512) << 20
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    rates: dict[str, Any] = {"memory_gbps": 2 * nbytes / seconds(lambda: dst.copy_(src)) / 1e9,
                             "fp8_tflops": None}
    n = 1024 if method.quick else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    rates["fp32_tflops"] = 2 * n**3 / seconds(lambda: a @ b) / 1e12
    route, ratio = _cpu_bf16_route()
    bf16_how = ("fp32 GEMM: oneDNN has no bf16 on this CPU, torch's bf16 GEMM is a scalar fallback" if not ratio
                else f"fp32 GEMM: torch's bf16 GEMM ran {ratio:.0f}x slower than fp32 here")
    rates["bf16_tflops"] = rates["fp32_tflops"]
    if route == "native":
        a16, b16 = a.bfloat16(), b.bfloat16()
        native = 2 * n**3 / seconds(lambda: a16 @ b16) / 1e12
        if native >= rates["fp32_tflops"]:
            rates["bf16_tflops"], bf16_how = native, "native bf16 GEMM"
        else:
            bf16_how = "fp32 GEMM: faster than torch's bf16 GEMM here"
    how = {"timer": "/".join(sorted(timers)), **method.describe(), "copy_bytes": nbytes, "matmul_n": n,
           "bf16": bf16_how}
    return rates, how


def _cpu_bf16_route(n: int = 256) -> tuple[str, float]:
    """Whether torch's bf16 GEMM is a real bf16 route on this CPU: ``("native", x)`` or
    ``("fp32", x)``, x how many times slower the other route ran (0: not timed).

    torch runs bf16 GEMMs through oneDNN's bf16 kernels where oneDNN supports bf16 here (AVX512,
    AMX, Arm's bf16 extension) and through a scalar fallback elsewhere: 2.1 s at n = 1024 on the
    2-core AVX2 EPYC VM, 190x its fp32 time, which made issue 24's 0.001 TFLOP/s bf16 ceiling and
    rows at 14,000% of it. A bf16 kernel on such a CPU converts to fp32 and runs fp32 FMAs, so
    fp32's rate is its ceiling. Where oneDNN says it has no bf16, the fallback is never timed (at
    the ceiling's size it takes minutes); elsewhere one thread times both routes on a small
    problem (one thread: on a busy 2-core VM a 2-thread GEMM's barrier waits swamp a 0.2 ms
    call), and the caller measures the native one at full size only if it came within 2x."""
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: let the timing decide
        supported = True
    if not supported:
        return "fp32", 0.0
    a, b = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a.bfloat16(), b.bfloat16()

    def fastest(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)  # min: a probe that picks a route, not a rate; load only ever adds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        native, fp32 = fastest(lambda: a16 @ b16), fastest(lambda: a @ b)
    finally:
        torch.set_num_threads(threads)
    return ("native", fp32 / native) if native < 2 * fp32 else ("fp32", native / fp32)
