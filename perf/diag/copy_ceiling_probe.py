"""Why perf/ceilings.py measures bandwidth with an elementwise kernel: the same 2 GiB copy timed
one call at a time (CUDA events) and by CUDA-graph replay (the bench's timer), as ``copy_`` and as
two elementwise kernels that read and write the same bytes through the SMs. On the H100
(2026-11-24): copy_ 2973 GB/s eager but 2436 replayed (in a graph it is a memcpy node); neg and
mul 2942-3004 eager, 3018 replayed.

    python perf/diag/copy_ceiling_probe.py
"""

from __future__ import annotations

import json
import statistics

import torch

from kernelmux.perf.timing import graph_replay_time


def _one_call_at_a_time(fn, trials: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(trials):
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def main() -> None:
    nbytes = 2 << 30
    src = torch.empty(nbytes // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ops = {"copy_": lambda: dst.copy_(src), "neg": lambda: torch.neg(src, out=dst),
           "mul1": lambda: torch.mul(src, 1.0, out=dst)}
    gbps = {}
    for name, fn in ops.items():
        gbps[f"{name}_eager"] = 2 * nbytes / _one_call_at_a_time(fn) / 1e9
    for name, fn in ops.items():
        gbps[f"{name}_graph"] = 2 * nbytes / (graph_replay_time(lambda fn=fn: fn(), [{}]).median_us / 1e6) / 1e9
    print(json.dumps({"device": torch.cuda.get_device_name(), "gbps": {k: round(v, 1) for k, v in gbps.items()}}))


if __name__ == "__main__":
    main()
