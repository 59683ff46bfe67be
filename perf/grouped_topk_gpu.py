"""grouped_topk on the GPU at DeepSeek-V3 routing: the Triton kernel against the torch reference,
eager and compiled, by CUDA-graph replay, with the copy-bandwidth roofline from the same run; with
--sweep, every launch configuration of a grid per T (the data behind the backend's launch table)."""

# python -m kernelmux.perf.grouped_topk_gpu --out DIR [--sweep]
# The "triton" rows time the kernel at its table's launch config. Writes grouped_topk_gpu.json and
# .md into --out.

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kernelmux.perf import ceilings, records
from kernelmux.perf.timing import Timing, checked_replay_time, graph_replay_time, rotated_inputs

TOKENS = (1, 64, 1024, 8192, 16384)
SWEEP_BLOCK_T = (1, 2, 4, 8, 16, 32)
SWEEP_WARPS = (1, 2, 4, 8)


def _environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        **records.header(0),
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "capability": f"{props.major}.{props.minor}",
        "driver": records.driver_version(),
        "cuda": torch.version.cuda,
    }


def _row(name: str, tokens: int, timing: Timing, nbytes: int, bandwidth: float) -> dict[str, Any]:
    floor_us = nbytes / (bandwidth * 1e9) * 1e6
    return {"impl": name, "tokens": tokens, "median_us": timing.median_us, "p20_us": timing.p20_us,
            "p80_us": timing.p80_us, "bytes": nbytes, "roofline_us": floor_us,
            "pct_of_roofline": 100 * floor_us / timing.median_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2

    from kernelmux.backends.triton import grouped_topk as triton_module
    from kernelmux.specs.grouped_topk import SPEC

    env = _environment()
    bandwidth = ceilings.measure("cuda", only=("memory_gbps",))["memory_gbps"]
    compiled_reference = torch.compile(SPEC.reference, dynamic=False)
    impls = {"triton": triton_module.grouped_topk, "torch_eager": SPEC.reference,
             "torch_compile": compiled_reference}
    rows, sweep = [], []
    for tokens in TOKENS:
        case = SPEC.case(f"deepseek_v3_t{tokens}")
        probe = case.build("cuda", 0)
        nbytes = SPEC.cost(probe).bytes
        inputs = rotated_inputs(lambda seed: case.build("cuda", seed), env["l2_bytes"], cap=32, first=probe,
                                bytes_per_call=nbytes)
        for kwargs in inputs[:2]:  # correctness first, on the same inputs that are timed
            for fn in impls.values():
                SPEC.check_close(fn(**kwargs), SPEC.reference(**kwargs), kwargs)
        for name, fn in impls.items():
            rows.append(_row(name, tokens, graph_replay_time(fn, inputs), nbytes, bandwidth))
            print(f"T={tokens:6d} {name:14s} {rows[-1]['median_us']:8.2f} us", flush=True)
        if args.sweep:
            for block_t in SWEEP_BLOCK_T:
                for warps in SWEEP_WARPS:
                    config = triton_module.LaunchConfig(block_t=block_t, num_warps=warps)
                    row = {"tokens": tokens, "block_t": block_t, "num_warps": warps, "median_us": None}
                    sweep.append(row)
                    try:
                        with triton_module.override_launch_config(config):
                            # Every configuration is checked before it is timed.
                            timing = checked_replay_time(
                                triton_module.grouped_topk, inputs, SPEC.reference(**inputs[0]),
                                SPEC.check_close, trials=15)
                    except ValueError as refused:  # a known-bad configuration
                        row["status"] = f"refused: {refused}"
                        continue
                    except AssertionError as wrong:
                        row["status"] = f"WRONG: {str(wrong)[:200]}"
                        print(f"T={tokens} {config}: WRONG", flush=True)
                        continue
                    row.update(status="ok", median_us=timing.median_us)
            best = min((s for s in sweep if s["tokens"] == tokens and s["median_us"] is not None),
                       key=lambda s: s["median_us"])
            print(f"T={tokens:6d} sweep best: {best}", flush=True)

    result = {"op": "grouped_topk", "case": "DeepSeek-V3 routing (E 256, G 8, topk_group 4, top 8, "
              "sigmoid + bias, fp32 logits)", "method": "CUDA-graph replay of 32 calls, inputs rotated "
              "over 3x L2, median of 30 replays", "environment": env,
              "ceilings": {"copy_bandwidth_gbps": bandwidth}, "rows": rows, "sweep": sweep}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grouped_topk_gpu.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# grouped_topk on {env['device']} ({env['timestamp']})", "",
        f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, driver {env['driver']}, "
        f"commit {env['commit'] or 'unknown'}. Measured copy bandwidth {bandwidth:.0f} GB/s.", "",
        f"Method: {result['method']}.", "",
        "| T | triton us | torch eager us | torch.compile us | triton vs eager | triton vs compile | triton % of roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for tokens in TOKENS:
        by = {r["impl"]: r for r in rows if r["tokens"] == tokens}
        t, e, c = by["triton"], by["torch_eager"], by["torch_compile"]
        lines.append(f"| {tokens} | {t['median_us']:.2f} | {e['median_us']:.2f} | {c['median_us']:.2f} | "
                     f"{e['median_us'] / t['median_us']:.1f}x | {c['median_us'] / t['median_us']:.1f}x | "
                     f"{t['pct_of_roofline']:.0f}% |")
    if sweep:
        lines += ["", "Sweep: best launch config per T.", "",
                  "| T | block_t | num_warps | us |", "|---|---|---|---|"]
        for tokens in TOKENS:
            mine = [s for s in sweep if s["tokens"] == tokens and s["median_us"] is not None]
            if mine:
                b = min(mine, key=lambda s: s["median_us"])
                lines.append(f"| {tokens} | {b['block_t']} | {b['num_warps']} | {b['median_us']:.2f} |")
    (args.out / "grouped_topk_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
