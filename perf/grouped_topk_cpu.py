"""grouped_topk on the CPU: the cpu backend against the torch reference on the spec's model cases.

    python -m kernelmux.perf.grouped_topk_cpu [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from kernelmux.backends.cpu.grouped_topk import grouped_topk as cpu_grouped_topk
from kernelmux.engine import detect
from kernelmux.ops.specs.grouped_topk import SPEC

CASES = ("deepseek_v3_t1", "deepseek_v3_t64", "deepseek_v3_t1024", "deepseek_v3_t8192",
         "deepseek_v2_t1024", "qwen3_30b_a3b_t1024", "mixtral_8x7b_t1024")


def _median_us(fn, kwargs, budget_s: float = 1.0) -> float:
    for _ in range(3):
        fn(**kwargs)
    samples, spent = [], 0.0
    while spent < budget_s or len(samples) < 10:
        start = time.perf_counter()
        fn(**kwargs)
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for name in CASES:
        kwargs = SPEC.case(name).build("cpu", 0)
        SPEC.check_close(cpu_grouped_topk(**kwargs), SPEC.reference(**kwargs), kwargs)
        reference_us = _median_us(SPEC.reference, kwargs)
        cpu_us = _median_us(cpu_grouped_topk, kwargs)
        rows.append({"case": name, "reference_us": reference_us, "cpu_us": cpu_us,
                     "speedup": reference_us / cpu_us})
        print(f"{name:22s} reference {reference_us:10.1f} us  cpu {cpu_us:10.1f} us  "
              f"{reference_us / cpu_us:5.2f}x", flush=True)
    result = {"environment": {"cpu": detect("cpu").device_name, "machine": platform.machine(),
                              "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "python": sys.version.split()[0]}, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
