"""Where a decode call's time goes on the GPU: 32 calls of the triton backend's paged_attention /
mla_decode per named case, captured in one CUDA graph and replayed under the torch profiler; per
call, the span, each kernel's duration and the idle time between kernels."""

#     python perf/diag/attention_timeline.py --cases llama3_70b_tp8_fp8_decode_b64_ctx4096 --out DIR
#
# (perf/run_gpu.sh's timeline-attention step.) The calls are captured as the bench times them; the
# idle time is reported within a call and from one call to the next. Writes attention_timeline.json
# and prints a table.

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from attention_profile import case_call  # this folder: on sys.path when run as a script

from kernelmux.perf import records

DEFAULT_CASES = [
    "llama3_70b_tp8_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b64_ctx4096",
    "llama3_70b_tp8_fp8_decode_b8_ctx32768", "llama3_8b_fp8_decode_b64_ctx4096",
]
CALLS = 32
REPLAYS = 5


def _kernels(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda e: e["ts"])


def timeline(name: str, device: torch.device, backend: str = "triton") -> dict:
    fn, kwargs = case_call(name, device, backend)
    fn(**kwargs)  # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(**kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(**kwargs)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        kernels = _kernels(path)
    total = CALLS * REPLAYS
    if not kernels or len(kernels) % total:
        raise RuntimeError(f"{name}: {len(kernels)} kernel records for {total} calls")
    kernels_per_call = len(kernels) // total
    names = [k["name"].split("(")[0][:40] for k in kernels[:kernels_per_call]]
    durations = {i: [] for i in range(kernels_per_call)}
    gaps = {i: [] for i in range(kernels_per_call)}  # idle before kernel i of a call
    spans = []
    for call in range(total):
        ks = kernels[call * kernels_per_call:(call + 1) * kernels_per_call]
        spans.append(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"])
        for i, k in enumerate(ks):
            durations[i].append(k["dur"])
            index = call * kernels_per_call + i
            if index > 0 and (i > 0 or call % CALLS):  # not across graph replays
                before = kernels[index - 1]
                gaps[i].append(k["ts"] - (before["ts"] + before["dur"]))
    return {
        "case": name,
        "calls": total,
        "span_us": statistics.median(spans),
        "per_call_us": statistics.median(spans) + statistics.median(gaps[0]),
        "kernels": [{"name": names[i], "us": statistics.median(durations[i]),
                     "idle_before_us": statistics.median(gaps[i]) if gaps[i] else None}
                    for i in range(kernels_per_call)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--out", default=".")
    parser.add_argument("--backend", default="triton", choices=["triton", "cuda"])
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = [timeline(name, device, args.backend) for name in args.cases]
    report = {
        **records.header(device), "backend": args.backend,
        "method": f"{CALLS} calls in one CUDA graph, {REPLAYS} replays under torch.profiler (CUPTI kernel "
                  "records); medians per call",
        "rows": rows,
    }
    with open(os.path.join(args.out, "attention_timeline.json"), "w") as f:
        json.dump(report, f, indent=1)
    for row in rows:
        parts = ", ".join(f"{k['name']} {k['us']:.1f} us (idle before {k['idle_before_us']:.1f})"
                          for k in row["kernels"])
        print(f"{row['case']:42s} call {row['per_call_us']:6.1f} us: {parts}")


if __name__ == "__main__":
    main()
