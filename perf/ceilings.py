"""Ceilings for the roofline, measured in the same run as the rows they judge: memory bandwidth
(a large copy through the SMs, bytes read plus written) and dense matrix rates (bf16, fp8 where
the GPU has it, fp32), with the datasheet values of the GPUs we run on beside them.

On a GPU each ceiling is timed the way the bench times its rows (CUDA-graph replay: 32 calls a
graph, ``replay_trials`` replays), so both see the same load. That matters for compute: about a
second of full tensor load takes an H100 to its 700 W limit and its clock from 1980 to
1575-1740 MHz (perf/notes/attention.md, round 10), so a matmul timed one call at a time runs
faster than any long compute-bound row can, and judged such rows by a rate they never had. The
one-call-at-a-time rates are kept beside them as ``<name>_burst``; a compute-bound row much
shorter than the ceiling's matmuls runs cooler than they did, which those show.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Collection, Optional

import torch

from kernelmux.perf.timing import graph_replay_time, replay_trials

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


NAMES = ("memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops")


def _cuda_probes(quick: bool, names: set[str]) -> dict[str, Optional[tuple[Callable[[], Any], float]]]:
    """Each named ceiling's operation and its work (GB moved or TFLOP) per call; None where the
    GPU has no instruction for it (fp8 before sm_89). Only the named ones' operands are allocated."""
    nbytes, n = (512 << 20, 4096) if quick else (2 << 30, 8192)
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


def measure(device: str, quick: bool = False, only: Optional[Collection[str]] = None) -> dict[str, Any]:
    """``{"memory_gbps", "bf16_tflops", "fp8_tflops", "fp32_tflops"}`` for ``device`` ("cuda" or
    "cpu"); a rate the device has no instruction for is None. On a GPU these are timed as the
    bench's rows are, and each has a ``<name>_burst`` twin timed one call at a time (module
    docstring). ``quick`` uses smaller problems (less accurate, for --quick runs). ``only`` (names
    from NAMES): just those on a GPU, e.g. a diagnostic that needs the copy bandwidth alone skips
    the matmuls' ~10 s (the CPU's are quick, and always all measured)."""
    names = set(NAMES if only is None else only)
    if not names <= set(NAMES):
        raise ValueError(f"ceilings.measure: only takes names from {NAMES}, got {sorted(names - set(NAMES))}")
    if device == "cuda":
        probes = _cuda_probes(quick, names)

        def rate(probe, seconds: Callable[[Callable[[], Any]], float]) -> Optional[float]:
            return None if probe is None else probe[1] / seconds(probe[0])

        def replayed_seconds(fn: Callable[[], Any]) -> float:
            return graph_replay_time(fn, [{}], trials=replay_trials(quick)).median_us / 1e6

        # Every burst first, while the GPU is cool, then the sustained replays.
        burst = {f"{name}_burst": rate(probe, lambda fn: _cuda_seconds(fn, 10)) for name, probe in probes.items()}
        sustained = {name: rate(probe, replayed_seconds) for name, probe in probes.items()}
        del probes
        torch.cuda.empty_cache()  # the operands and the replays' outputs, before the rows need the memory
        return {**sustained, **burst}
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
