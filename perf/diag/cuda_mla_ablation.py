"""What each part of the cuda backend's Hopper MLA kernel costs: the kernel timed as built, then
rebuilt with one part left out at a time (KERNELMUX_DIAG_SKIP_*, kernels/diagnostics.cuh: the score
MMAs, the value MMAs, the cache loads after the first two tiles). The left-out builds compute
wrong results; only their times mean anything. Times are CUDA-graph replays; percentages are of
the copy bandwidth measured in the same run.

    python perf/diag/cuda_mla_ablation.py --out DIR [--cases NAME ...] [--variants LABEL ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kernelmux.backends.cuda import _compile
from kernelmux.backends.cuda import mla_decode as mla
from kernelmux.specs._spec import Case
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import graph_replay_time

CASES = ["deepseek_v3_h128_decode_b64_ctx4096", "deepseek_v3_h128_decode_b128_ctx4096",
         "deepseek_v3_h128_fp8_decode_b64_ctx4096"]
VARIANTS = {
    "as built": (),
    "no score MMAs": ("KERNELMUX_DIAG_SKIP_SCORES",),
    "no value MMAs": ("KERNELMUX_DIAG_SKIP_VALUES",),
    "no MMAs": ("KERNELMUX_DIAG_SKIP_SCORES", "KERNELMUX_DIAG_SKIP_VALUES"),
    "no loads after two tiles": ("KERNELMUX_DIAG_SKIP_LOADS",),
    "no fp8 conversion": ("KERNELMUX_DIAG_SKIP_CONVERT",),  # the tiles stored as fetched
}
FP8_ONLY = {"no fp8 conversion"}
# Beyond the spec's cases: 64 heads (one CTA a sequence, so no second CTA reading the same tiles).
EXTRA_CASES = {
    "deepseek_v3_h64_decode_b128_ctx4096": lambda: mla_spec._deepseek(128, 4096, 64),
    "deepseek_v3_h64_fp8_decode_b128_ctx4096": lambda: mla_spec._deepseek(128, 4096, 64, cache_dtype=mla.FP8,
                                                                          kv_scale=0.23),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=CASES + list(EXTRA_CASES))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), help="labels of VARIANTS to run")
    args = parser.parse_args()
    started = time.perf_counter()
    copy = ceilings_module.measure("cuda", only=("memory_gbps",))["memory_gbps"]
    print(f"ceilings measured at {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for name in args.cases:
        extra = EXTRA_CASES.get(name)
        case = Case(name, extra(), frozenset(), name) if extra else mla_spec.SPEC.case(name)
        kwargs = case.build("cuda", 0)
        nbytes = mla_spec.SPEC.cost(kwargs).bytes
        floor_us = nbytes / (copy * 1e3)
        for label in args.variants:
            if label in FP8_ONLY and kwargs["kv_cache"].dtype != mla.FP8:
                continue
            defines = VARIANTS[label]
            with _compile.diagnostics(*defines):
                timing = graph_replay_time(mla.mla_decode, [kwargs], calls_per_graph=8, trials=10)
            rows.append({"case": name, "variant": label, "defines": list(defines), "us": timing.median_us,
                         "pct_of_copy": 100 * floor_us / timing.median_us})
            print(f"{name:40s} {label:26s} {timing.median_us:8.1f} us  "
                  f"{rows[-1]['pct_of_copy']:5.1f}% of copy  (at {time.perf_counter() - started:.0f} s)", flush=True)
    record = {**records.header(), "copy_gbps": copy, "rows": rows}
    with open(os.path.join(args.out, "cuda_mla_ablation.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
