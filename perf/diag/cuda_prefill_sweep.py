"""Plan sweep for the cuda backend's Hopper prefill kernel on the prefill cases: each plan
checked against the spec's reference before it is timed (CUDA-graph replay), with the triton
backend's kernel and torch's SDPA (FlashAttention on dense, unpaged K and V: the peer) on the same
inputs. Each is timed three ways: as the bench times (32 calls a graph, 30 replays: about a
second of load, long enough for the H100 to reach its power limit and lower its clock), replaying
one input set (`us`) and rotating through input sets spanning 3x the L2 as the bench does
(`rotated_us`: each call's K and V start in device memory); and in short bursts of one input set
(`burst_us`: 2 calls a graph, near the boost clock; the steadiest for comparing versions). Rates
are the spec's FLOP count (causal pairs counted once) over the median time, as a percent of the
bf16 matmul rate measured in the same run the same way: the sustained times against the ceiling
timed as the bench times (perf/ceilings.py), the bursts against its one-call-at-a-time twin.
backends/cuda/_paged_prefill.py's DEFAULT_PLAN is chosen from these numbers (perf/decisions/paged_attention.md).

    python perf/diag/cuda_prefill_sweep.py --out DIR [--cases NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from kernelmux.backends.cuda import _paged_prefill as prefill
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.backends.triton import paged_attention as triton_paged_attention
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import graph_replay_time, rotated_inputs

CASES = ["llama3_8b_prefill_t8192", "llama3_8b_prefill_t1024", "llama3_8b_prefill_t1024_4seqs",
         "llama3_8b_chunked_prefill"]


def _dense_sdpa(inputs):
    """The peer: torch's SDPA over each input set's one sequence, K and V gathered densely
    (outside the timing), causal, GQA heads expanded by SDPA itself. None for batches of several
    sequences or non-causal cases."""
    dense = {}
    for kwargs in inputs:
        if kwargs["seq_lens"].shape[0] != 1 or not kwargs["causal"]:
            return None
        length, block = int(kwargs["seq_lens"][0]), kwargs["k_cache"].shape[1]
        if kwargs["query"].shape[0] != length:
            return None
        blocks = kwargs["block_table"][0, : -(-length // block)].long()
        k = kwargs["k_cache"][blocks].flatten(0, 1)[:length].transpose(0, 1)[None]
        v = kwargs["v_cache"][blocks].flatten(0, 1)[:length].transpose(0, 1)[None]
        dense[id(kwargs["query"])] = (kwargs["query"].transpose(0, 1)[None], k, v, kwargs["scale"])

    def run(query, **_):
        q, k, v, scale = dense[id(query)]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=CASES)
    args = parser.parse_args()
    ceilings = ceilings_module.measure("cuda", only=("bf16_tflops",))
    matmul, matmul_burst = ceilings["bf16_tflops"], ceilings["bf16_tflops_burst"]
    print(f"bf16 matmul {matmul:.1f} TFLOP/s sustained, {matmul_burst:.1f} in bursts", flush=True)
    rows = []
    record = {**records.header(),
              "ceilings": ceilings, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    for case in args.cases:
        spec_case = pa_spec.SPEC.case(case)
        kwargs = spec_case.build(torch.device("cuda"), 0)
        cost = pa_spec.SPEC.cost(kwargs)
        expected = pa_spec.SPEC.reference(**kwargs)
        rotated = rotated_inputs(lambda seed: spec_case.build(torch.device("cuda"), seed), l2_bytes, cap=8,
                                 first=kwargs)
        variants = [("cuda", dataclasses.asdict(prefill.PrefillPlan(s, o, p))) for s in prefill.STAGES
                    for o, p in ((False, False), (True, False), (True, True))]
        variants.append(("triton", {}))
        sdpa = _dense_sdpa(rotated)
        if sdpa is not None:
            variants.append(("sdpa", {}))
        for backend, fields in variants:
            fn = {"cuda": cuda_paged_attention.paged_attention, "triton": triton_paged_attention.paged_attention,
                  "sdpa": sdpa}[backend]
            row = {"case": case, "backend": backend, "plan": fields, "rotation": len(rotated)}
            try:
                with prefill.override_plan(**fields):
                    if backend != "sdpa":
                        pa_spec.SPEC.check_close(fn(**kwargs), expected, kwargs)
                    # Short bursts of one input set first (before a second of load heats the
                    # GPU), then the bench's replay (32 calls a graph, 30 replays: sustained, as
                    # the goal is measured) of one input set and rotating.
                    row["burst_us"] = graph_replay_time(fn, [kwargs], calls_per_graph=2, trials=10).median_us
                    row["us"] = graph_replay_time(fn, [kwargs]).median_us
                    row["rotated_us"] = graph_replay_time(fn, rotated).median_us
                flops = cost.flops / 1e6
                for key, rate in (("us", matmul), ("rotated_us", matmul), ("burst_us", matmul_burst)):
                    row[key.replace("us", "matmul_pct")] = 100 * flops / row[key] / rate
                row["status"] = "ok"
            except AssertionError as error:
                row.update(status="wrong", error=str(error)[:300])
            rows.append(row)
            shown = (f"{row['us']:7.1f} us {row['matmul_pct']:4.1f}%, rotated {row['rotated_us']:7.1f} us "
                     f"{row['rotated_matmul_pct']:4.1f}%, burst {row['burst_us']:7.1f} us "
                     f"{row['burst_matmul_pct']:4.1f}%" if "rotated_us" in row else row["error"])
            print(f"{case:30s} {backend:6s} {fields!s:52s} {shown}", flush=True)
        del kwargs, expected, rotated, sdpa
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "cuda_prefill_sweep.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    main()
