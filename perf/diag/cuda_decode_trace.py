"""Where the cuda backend's fp8 decode kernel spends a call: per CTA, %globaltimer at its entry,
when its sequence length arrives, when its first K row arrives, when warp 0 finishes streaming,
when every warp has, and when its stores are issued (the kernel compiled with KERNELMUX_DIAG_TRACE,
which adds the marks and nothing else; see kernels/diagnostics.cuh). Prints, per case, each mark's
spread over the CTAs relative to the first entry, the stage durations and the number of CTAs
running in each microsecond, against the time the spec's bytes take at the copy bandwidth
measured in the same run.

    python perf/diag/cuda_decode_trace.py --out DIR [--cases NAME ...] [--splits N] [--defines MACRO ...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os

import numpy as np
import torch

from kernelmux.backends.cuda import _compile, _driver, _paged_decode
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records

CASES = ["llama3_70b_tp8_fp8_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b8_ctx32768",
         "llama3_8b_fp8_decode_b64_ctx4096"]
MARKS = ["entry", "length", "first K", "warp 0 done", "all warps done", "maxima read", "stores issued"]
MARK_SLOTS = [0, 1, 2, 3, 4, 6, 5]  # the .cu file's trace slot of each mark (slot 7: the SM)
TRACE_CTAS, TRACE_SLOTS = 1 << 16, 8  # the .cu file's kTraceCtas x 8 words


def read_trace(kernel: _driver.Kernel, ctas: int) -> np.ndarray:
    pointer, size = _driver.module_global(kernel, "kernelmux_trace")
    host = np.zeros((TRACE_CTAS, TRACE_SLOTS), dtype=np.uint64)
    assert host.nbytes == size, (host.nbytes, size)
    _driver.copy_to_host(pointer, host.ctypes.data_as(ctypes.c_void_p), size)
    return host[:ctas]


def clear_trace(kernel: _driver.Kernel) -> None:
    _driver.clear_device(*_driver.module_global(kernel, "kernelmux_trace"))


def summarize(trace: np.ndarray) -> dict:
    times = trace[:, MARK_SLOTS].astype(np.int64)
    last = len(MARKS) - 1
    t0 = times[:, 0].min()
    rel = (times - t0) / 1e3  # us
    quantiles = {name: np.percentile(rel[:, i], [0, 10, 50, 90, 100]).round(2).tolist()
                 for i, name in enumerate(MARKS)}
    stages = {f"{MARKS[i]} -> {MARKS[i + 1]}": np.percentile(rel[:, i + 1] - rel[:, i], [10, 50, 90]).round(2)
              .tolist() for i in range(last)}
    end = rel[:, last].max()
    bins = np.arange(0, np.ceil(end) + 1)
    running = [int(((rel[:, 0] <= b) & (rel[:, last] > b)).sum()) for b in bins]
    per_sm = np.bincount(trace[:, 7].astype(np.int64))
    return dict(span_us=round(float(end), 2), marks_us=quantiles, stages_us=stages, running_per_us=running,
                ctas=int(trace.shape[0]), sms=int((per_sm > 0).sum()), most_ctas_per_sm=int(per_sm.max()),
                sm_ids=sorted(set(trace[:, 7].astype(int).tolist())),
                # per CTA: its SM and when its last warp finished streaming (us)
                sm_and_stream_end_us=[[int(sm), round(float(end), 2)] for sm, end in zip(trace[:, 7], rel[:, 4])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=CASES)
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--defines", nargs="*", default=[],
                        help="more diagnostic macros to compile the kernel with (_compile.DIAGNOSTICS)")
    args = parser.parse_args()
    copy = ceilings_module.measure("cuda", only=("memory_gbps",))["memory_gbps"]
    record = {**records.header(),
              "copy_gbps": copy, "cases": {}}
    lines = [f"copy bandwidth {copy:.1f} GB/s"]
    for case in args.cases:
        kwargs = pa_spec.SPEC.case(case).build(torch.device("cuda"), 0)
        ideal_us = pa_spec.SPEC.cost(kwargs).bytes / copy / 1e3
        _paged_decode._LOADED.clear()  # so the kernel this case loads last is the one it runs
        with _compile.diagnostics("KERNELMUX_DIAG_TRACE", *args.defines), \
                _paged_decode.override_plan(num_splits=args.splits):
            expected = pa_spec.SPEC.reference(**kwargs)
            pa_spec.SPEC.check_close(cuda_paged_attention.paged_attention(**kwargs), expected, kwargs)
            decode = _paged_decode._LOADED.loaded()[-1][0]
            runs = []
            for _ in range(5):
                for _ in range(3):
                    cuda_paged_attention.paged_attention(**kwargs)
                torch.cuda.synchronize()
                clear_trace(decode)
                cuda_paged_attention.paged_attention(**kwargs)
                torch.cuda.synchronize()
                num_seqs, num_kv_heads = kwargs["seq_lens"].shape[0], kwargs["k_cache"].shape[2]
                trace = read_trace(decode, TRACE_CTAS)
                ctas = int((trace[:, 0] > 0).sum())
                assert ctas % (num_seqs * num_kv_heads) == 0, (ctas, num_seqs, num_kv_heads)
                runs.append(summarize(trace[:ctas]))
        runs.sort(key=lambda r: r["span_us"])
        median = runs[len(runs) // 2]
        median.update(ideal_us=round(ideal_us, 2), spans_us=[r["span_us"] for r in runs])
        record["cases"][case] = median
        lines.append(f"\n{case}: {median['ctas']} CTAs on {median['sms']} SMs "
                     f"(<= {median['most_ctas_per_sm']} per SM); span {median['span_us']} us "
                     f"(runs {median['spans_us']}), bytes at copy rate {ideal_us:.2f} us")
        lines.append("  mark (us after the first entry)   min     p10     p50     p90     max")
        for name, q in median["marks_us"].items():
            lines.append(f"  {name:32s}" + "".join(f"{v:8.2f}" for v in q))
        lines.append("  stage (us)                         p10     p50     p90")
        for name, q in median["stages_us"].items():
            lines.append(f"  {name:32s}" + "".join(f"{v:8.2f}" for v in q))
        lines.append("  CTAs running per us: " + " ".join(map(str, median["running_per_us"])))
        print("\n".join(lines[-(len(MARKS) * 2 + 3):]), flush=True)  # this case's lines
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cuda_decode_trace.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "cuda_decode_trace.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
