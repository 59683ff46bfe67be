"""Diagnostic: show that `kernelmux bench --compare` is quiet on noise and catches a slowdown, by
running the bench twice unchanged and once with one backend slowed by a fixed wait per call."""

#     python perf/diag/compare_demo.py --op grouped_topk --backend triton --delay-us 5 --out DIR
#
# The two unchanged runs give the run-to-run spread; the slowed backend is a copy of itself that
# waits a fixed time per call (on CUDA a device-side sleep inside the timed region, on CPUs a busy
# wait). Compares the second and third runs against the first and writes all three JSON files.

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import torch

from kernelmux.engine import Engine, Settings
from kernelmux.specs import ALL_SPECS
from kernelmux.perf import bench, ceilings
from kernelmux.registry import Registry


def _delayed(fn, delay_us: float):
    """``fn`` plus a fixed wait, keeping its signature (the registry checks it)."""
    if torch.cuda.is_available():
        # torch.cuda._sleep spins for a number of GPU cycles: calibrate cycles per microsecond.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        cycles = int(delay_us * 1_000_000 / (start.elapsed_time(end) * 1e3))

        def wait() -> None:
            torch.cuda._sleep(cycles)
    else:
        def wait() -> None:
            deadline = time.perf_counter() + delay_us / 1e6
            while time.perf_counter() < deadline:
                pass

    @functools.wraps(fn)
    def slowed(*args, **kwargs):
        wait()
        return fn(*args, **kwargs)

    return slowed


def _slowed_engine(op: str, backend: str, delay_us: float) -> Engine:
    specs = {spec.name: spec for spec in ALL_SPECS}
    registry = Registry(specs)
    registry.load_entry_points()
    # The implementation replaced in place by a slowed copy of itself: the same backend name (so
    # --compare pairs the rows), plugin, supports() and requirements. Built-in backend names are
    # reserved, so a separate plugin could not register it.
    original = registry.implementations[(op, backend)]
    registry.implementations[(op, backend)] = dataclasses.replace(
        original, fn=_delayed(original.fn, delay_us), description=f"{original.description} + {delay_us} us wait")
    return Engine(ALL_SPECS, Settings(), registry=registry)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="grouped_topk")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--delay-us", type=float, default=5.0)
    parser.add_argument("--threshold", type=float, default=10.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = bench.Plan(ops=[args.op], backends=None, cases=None, quick=False, baseline=None, flush_l2=False,
                      budget_s=0.5, seed=0, device=device)
    measured = ceilings.measure(device)  # one measurement: the three runs differ only in the code
    quiet = lambda line: None  # noqa: E731
    runs = {
        "a": bench.run(plan, quiet, ceilings=measured),
        "b": bench.run(plan, quiet, ceilings=measured),
        "slowed": bench.run(plan, quiet, engine=_slowed_engine(args.op, args.backend, args.delay_us),
                            ceilings=measured),
    }
    for name, result in runs.items():
        result["environment"]["commit"] += f"-{name}"
        with open(os.path.join(args.out, f"compare_demo_{args.op}_{name}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("== run b against run a (unchanged code: the spread)")
    noise = bench.compare(runs["b"], runs["a"], args.threshold)
    print(f"== slowed run against run a ({args.backend} + {args.delay_us} us per call)")
    caught = bench.compare(runs["slowed"], runs["a"], args.threshold)
    print(f"unchanged: {noise} rows past {args.threshold}%; slowed: {caught} rows past it")
    return 0 if noise == 0 and caught > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
