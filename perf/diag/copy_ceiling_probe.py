"""Why perf/ceilings.py measures bandwidth with an elementwise kernel: a 2 GiB copy timed one call
at a time and by CUDA-graph replay, as ``copy_`` and as two elementwise kernels over the same bytes.
Run: python perf/diag/copy_ceiling_probe.py"""

# On the H100 (2026-11-24): copy_ 2973 GB/s eager but 2436 replayed (in a graph it is a memcpy
# node); neg and mul 2942-3004 eager, 3018 replayed.

from __future__ import annotations

import json

import torch

from kernelmux.perf import records
from kernelmux.perf.ceilings import _cuda_seconds as one_call_at_a_time_seconds
from kernelmux.perf.timing import graph_replay_time


def main() -> None:
    nbytes = 2 << 30
    src = torch.empty(nbytes // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ops = {"copy_": lambda: dst.copy_(src), "neg": lambda: torch.neg(src, out=dst),
           "mul1": lambda: torch.mul(src, 1.0, out=dst)}
    gbps = {}
    for name, fn in ops.items():
        gbps[f"{name}_eager"] = 2 * nbytes / one_call_at_a_time_seconds(fn, 20) / 1e9
    for name, fn in ops.items():
        gbps[f"{name}_graph"] = 2 * nbytes / (graph_replay_time(fn, [{}]).median_us / 1e6) / 1e9
    print(json.dumps({**records.header(), "gbps": {k: round(v, 1) for k, v in gbps.items()}}))


if __name__ == "__main__":
    main()
