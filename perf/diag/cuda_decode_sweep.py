"""Plan sweep for the cuda backend's fp8 paged-attention decode on the perf goals' fp8 shapes:
split counts, read-ahead and warps per CTA, each checked against the spec's reference before
it is timed (CUDA-graph replay over input sets spanning 3x the L2, as the bench), with the triton
backend's kernel on the same inputs for comparison. Bandwidth is the spec's byte count over the
median time, as a percent of the device-copy bandwidth measured in the same run. DEFAULT_PLAN,
_warps, split_count and wide_split_count in backends/cuda/_paged_decode.py are chosen from these
numbers (perf/decisions/paged_attention.md).

    python perf/diag/cuda_decode_sweep.py --out DIR [--cases NAME ...] [--splits 1 4 8 16]
        [--plans w16s2 w4a auto ...] [--shapes 32:4096:8:1 ...] [--repeat N] [--defines MACRO ...]
        [--no-triton]

A --plans entry names a DecodePlan: w<warps> (or auto: the default plan), s<splits> (else the
default's), a (read ahead), p / n (programmatic dependent launch on / off, else the default's);
without --plans, 4 and 8 warps with and without read-ahead at each --splits count. A --shapes
entry adds an fp8 decode case batch:context:heads:kv_heads (one query a sequence, block 16, the
goal cases' scales).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re

import torch

from kernelmux.backends.cuda import _compile, _paged_decode
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.backends.triton import paged_attention as triton_paged_attention
from kernelmux.specs._spec import Case
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import checked_replay_time, rotated_inputs

CASES = ["llama3_70b_tp8_fp8_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b8_ctx32768",
         "llama3_8b_fp8_decode_b64_ctx4096", "llama3_8b_fp8_decode_b8_ctx4096"]


def plan_fields(name: str) -> dict:
    """DecodePlan fields from a --plans entry such as ``w16s2`` or ``auto``."""
    match = re.fullmatch(r"(?:w(\d+)|auto)(?:s(\d+))?(a?)([pn]?)", name)
    if match is None:
        raise SystemExit(f"--plans entry {name!r} is not w<warps>|auto[s<splits>][a][p|n]")
    warps, splits, ahead, overlap = match.groups()
    return dict(warps=int(warps) if warps else None, num_splits=int(splits) if splits else None,
                read_ahead=bool(ahead), overlap={"": None, "p": True, "n": False}[overlap])


def builder(name: str):
    """(device, seed) -> kwargs for a spec case name or a --shapes entry."""
    match = re.fullmatch(r"(\d+):(\d+):(\d+):(\d+)", name)
    if match is None:
        return pa_spec.SPEC.case(name).build
    batch, context, heads, kv_heads = map(int, match.groups())
    make = pa_spec._decode(batch, context, heads, kv_heads, cache_dtype=torch.float8_e4m3fn, scales=(0.23, 0.31))
    return Case(name, make, frozenset(), "--shapes entry").build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=CASES)
    parser.add_argument("--splits", nargs="*", type=int, default=[])
    parser.add_argument("--plans", nargs="*", default=None)
    parser.add_argument("--shapes", nargs="*", default=[])
    parser.add_argument("--repeat", type=int, default=1, help="time every variant this many rounds")
    parser.add_argument("--defines", nargs="*", default=[],
                        help="diagnostic macros to compile the kernel with (_compile.DIAGNOSTICS, "
                             "kernels/diagnostics.cuh)")
    parser.add_argument("--no-triton", action="store_true",
                        help="leave out the triton backend's kernel (A/B runs of the cuda kernel alone)")
    args = parser.parse_args()
    with _compile.diagnostics(*args.defines):
        sweep(args)


def sweep(args: argparse.Namespace) -> None:
    ceilings = ceilings_module.measure("cuda", only=("memory_gbps",))
    copy = ceilings["memory_gbps"]
    print(f"copy bandwidth {copy:.1f} GB/s", flush=True)
    rows = []
    record = {**records.header(),
              "defines": args.defines, "ceilings": ceilings, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    if args.plans is None:
        variants = [("cuda", dict(read_ahead=ahead, warps=warps, num_splits=s)) for ahead, warps in
                    ((False, 4), (True, 4), (False, 8), (True, 8)) for s in [None, *args.splits]]
    else:
        variants = [("cuda", plan_fields(name)) for name in args.plans]
    if not args.no_triton:
        variants.append(("triton", {}))
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    for case in [*args.cases, *args.shapes]:
        build = builder(case)
        kwargs = build(torch.device("cuda"), 0)
        cost = pa_spec.SPEC.cost(kwargs)
        expected = pa_spec.SPEC.reference(**kwargs)
        # Input sets spanning 3x the L2, as the bench rotates them (each call reads from memory).
        inputs = rotated_inputs(lambda seed: build(torch.device("cuda"), seed), l2_bytes, 8, first=kwargs,
                                bytes_per_call=cost.bytes)
        for trial, (backend, fields) in itertools.product(range(args.repeat), variants):
            fn = cuda_paged_attention.paged_attention if backend == "cuda" else triton_paged_attention.paged_attention
            row = dict(case=case, backend=backend, plan=fields, trial=trial, input_sets=len(inputs))
            try:
                with _paged_decode.override_plan(**fields):
                    us = checked_replay_time(fn, inputs, expected, pa_spec.SPEC.check_close, calls_per_graph=8,
                                             trials=10).median_us
                row.update(us=us, bandwidth_pct=100 * cost.bytes / us / 1e3 / copy, status="ok")
            except AssertionError as error:
                row.update(status="wrong", error=str(error)[:300])
            rows.append(row)
            shown = f"{row['us']:8.1f} us {row['bandwidth_pct']:5.1f}% bw" if "us" in row else row["error"]
            print(f"{case:40s} {backend:6s} {str(fields):45s} {shown}", flush=True)
        del kwargs, expected, inputs
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "cuda_decode_sweep.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    main()
