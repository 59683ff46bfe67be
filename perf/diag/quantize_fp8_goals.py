"""Issue 29's quantize_fp8 goal shapes on the device: every granularity (per_tensor, per_token, per_group
1 x 128, and per_group with ue8m0 scales) at T = 1, 128 and 4096 x H = 2048 and 7168, bf16 input. Each
implementation that serves a shape (the triton backend's kernels, the cuda backend's where its supports takes
the call; the spec's reference as the peer) is
checked against the reference bit for bit (check_close), then timed by CUDA-graph replay over four
inputs; the profiler counts its kernel launches per call. Times are set against the copy bandwidth
measured in the same run: bytes = the input read + the codes and scales written, once each.

    python perf/diag/quantize_fp8_goals.py --out DIR [--tokens 1 128 4096] [--hidden 2048 7168]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kernelmux.backends.cuda import quantize_fp8 as cuda_quantize
from kernelmux.backends.triton import quantize_fp8 as triton_quantize
from kernelmux.platforms import detect
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import graph_replay_time
from kernelmux.specs import quantize_fp8 as spec

VARIANTS = {  # name: (granularity, ue8m0)
    "per_tensor": ("per_tensor", False),
    "per_token": ("per_token", False),
    "per_group": ("per_group", False),
    "per_group_ue8m0": ("per_group", True),
}
INPUTS = 4


def _inputs(tokens: int, hidden: int, granularity: str, ue8m0: bool, seed: int = 0) -> list[dict]:
    gen = torch.Generator("cuda").manual_seed(seed)
    return [dict(x=torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16),
                 granularity=granularity, group_size=128, ue8m0=ue8m0, fp8_dtype="e4m3fn")
            for _ in range(INPUTS)]


def _launches(fn, inputs) -> int:
    """Kernels one call launches (the profiler's count over a call per input, divided)."""
    from torch.profiler import ProfilerActivity, profile

    fn(**inputs[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for kwargs in inputs:
            fn(**kwargs)
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0)
    return round(kernels / len(inputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 128, 4096])
    parser.add_argument("--hidden", nargs="*", type=int, default=[2048, 7168])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    copy_gbps = ceilings_module.measure("cuda", only={"memory_gbps"})["memory_gbps"]
    impls = {"triton": triton_quantize.quantize_fp8, "cuda": cuda_quantize.quantize_fp8, "reference": spec.quantize_fp8}
    platform = detect(torch.device("cuda"))
    rows, lines = [], [f"copy {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})", "",
                       "| variant | T | H | impl | us | % of copy | launches | check |",
                       "|---|---|---|---|---|---|---|---|"]
    for variant, (granularity, ue8m0) in VARIANTS.items():
        for tokens in args.tokens:
            for hidden in args.hidden:
                inputs = _inputs(tokens, hidden, granularity, ue8m0)
                expected = spec.quantize_fp8(**inputs[0])
                nbytes = spec.cost(inputs[0]).bytes
                for name, fn in impls.items():
                    row = dict(variant=variant, tokens=tokens, hidden=hidden, impl=name, bytes=nbytes)
                    declined = name == "cuda" and cuda_quantize.supports(spec.validate(**inputs[0]), platform)
                    try:
                        if declined:
                            raise RuntimeError(f"declined: {declined}")
                        spec.check_close(fn(**inputs[0]), expected, inputs[0])
                        row["check"] = "ok"
                        row["us"] = graph_replay_time(fn, inputs, calls_per_graph=32, trials=10).median_us
                        row["copy_pct"] = 100 * nbytes / (row["us"] * 1e-6) / (copy_gbps * 1e9)
                        row["launches"] = _launches(fn, inputs)
                    except Exception as error:  # noqa: BLE001 - a failing row is reported, the rest still run
                        row["check"] = f"{type(error).__name__}: {str(error)[:160]}"
                    rows.append(row)
                    print(row, flush=True)
                    lines.append(f"| {variant} | {tokens} | {hidden} | {name} | {row.get('us', float('nan')):.2f} | "
                                 f"{row.get('copy_pct', float('nan')):.1f} | {row.get('launches', '-')} | "
                                 f"{row['check']} |")
    with open(os.path.join(args.out, "quantize_fp8_goals.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    with open(os.path.join(args.out, "quantize_fp8_goals.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
