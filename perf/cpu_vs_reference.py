"""The cpu backend against the torch references: every op the cpu backend implements, on its
spec's model cases, each output checked against the reference before it is timed.

    python -m kernelmux.perf.cpu_vs_reference [OPS...] [--json FILE] [--md FILE] [--budget S]

Timing: wall clock (time.perf_counter) around single calls after 2 warm-up calls, at least 5
samples and ``--budget`` seconds per implementation and case; the median is reported with the
20th and 80th percentiles. The machine's other load shows up as spread, so read p20-p80 too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

from kernelmux.engine import detect
from kernelmux.ops.specs import ALL_SPECS
from kernelmux.registry import Backend, Registry


def _samples_us(fn, kwargs, budget_s: float) -> list[float]:
    for _ in range(2):
        fn(**kwargs)
    samples: list[float] = []
    spent = 0.0
    while spent < budget_s or len(samples) < 5:
        start = time.perf_counter()
        fn(**kwargs)
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return [s * 1e6 for s in samples]


def _quantiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=10)
    return {"median_us": statistics.median(samples), "p20_us": cuts[1], "p80_us": cuts[7]}


def _commit() -> str:
    if os.environ.get("KERNELMUX_COMMIT"):
        return os.environ["KERNELMUX_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="ops to run (default: every op the cpu backend implements)")
    parser.add_argument("--json")
    parser.add_argument("--md")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per row")
    args = parser.parse_args(argv)

    specs = {spec.name: spec for spec in ALL_SPECS}
    registry = Registry(specs)
    registry.load_entry_points()
    cpu_impls = {impl.op: impl for impl in registry.implementations.values() if impl.backend == Backend.CPU}
    ops = args.ops or sorted(cpu_impls)
    unknown = [op for op in ops if op not in cpu_impls]
    if unknown:
        parser.error(f"no cpu implementation for {unknown}; the cpu backend implements {sorted(cpu_impls)}")

    rows = []
    for op in ops:
        spec, impl = specs[op], cpu_impls[op]
        for case in (c for c in spec.cases if "model" in c.tags):
            kwargs = case.build("cpu", 0)
            spec.check_close(impl.fn(**kwargs), spec.reference(**kwargs), kwargs)
            reference = _quantiles(_samples_us(spec.reference, kwargs, args.budget))
            cpu = _quantiles(_samples_us(impl.fn, kwargs, args.budget))
            row = {"op": op, "case": case.name, "reference": reference, "cpu": cpu,
                   "speedup": reference["median_us"] / cpu["median_us"]}
            rows.append(row)
            print(f"{op:16s} {case.name:40s} reference {reference['median_us'] / 1e3:9.2f} ms  "
                  f"cpu {cpu['median_us'] / 1e3:9.2f} ms  {row['speedup']:5.1f}x", flush=True)

    result = {
        "environment": {
            "cpu": detect("cpu").device_name, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernelmux": importlib.metadata.version("kernelmux"), "python": sys.version.split()[0],
            "commit": _commit(), "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "method": "wall clock per call, 2 warm-ups, >= 5 samples and --budget s per row; median, p20, p80",
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        env = result["environment"]
        lines = [f"# cpu backend against the references ({env['cpu']}, {env['threads']} threads)", "",
                 f"torch {env['torch']}, kernelmux {env['kernelmux']} at {env['commit']}, "
                 f"{env['timestamp']}.",
                 f"Method: {result['method']}.", "",
                 "| op | case | reference ms (p20-p80) | cpu ms (p20-p80) | speed-up |",
                 "|---|---|---|---|---|"]
        def ms(t: dict[str, float]) -> str:
            return f"{t['median_us'] / 1e3:.2f} ({t['p20_us'] / 1e3:.2f}-{t['p80_us'] / 1e3:.2f})"

        for r in rows:
            speedup = f"{r['speedup']:.1f}x"
            lines.append(f"| {r['op']} | {r['case']} | {ms(r['reference'])} | {ms(r['cpu'])} | {speedup} |")
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
