"""Launch-plan sweep for the triton backend's paged_attention and mla_decode on the perf goals'
shapes (the gpu-tagged cases), with dense torch SDPA as a peer: the data behind _attention.py's
_TABLE (perf/decisions/paged_attention.md, perf/decisions/mla_decode.md)."""

#     python perf/diag/attention_sweep.py --out DIR [--ops paged_attention mla_decode] [--kinds decode]
#         [--cases NAME ...] [--quick] [--budget-s 400] [--plans 16x64x4x3:8 16x64x4x4p:4 ...]
#
# Every plan is checked against the spec's reference before it is timed (CUDA-graph replay, the
# cache far larger than L2). Bandwidth is the spec's byte count over the median time, as a percent
# of the device-copy bandwidth measured in the same run; prefill is FLOP/s over the measured bf16
# matmul rate. The record is rewritten after every case, so a run cut off by a time limit keeps
# what it measured.

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kernelmux.backends.triton import _attention
from kernelmux.backends.triton.mla_decode import mla_decode
from kernelmux.backends.triton.paged_attention import paged_attention
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import graph_replay_time

DECODE_CASES = [
    "llama3_8b_decode_b64_ctx4096", "llama3_70b_tp8_decode_b64_ctx4096", "llama3_70b_tp8_decode_b8_ctx32768",
    "llama3_8b_fp8_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b64_ctx4096",
    "llama3_70b_tp8_fp8_decode_b8_ctx32768",
]
PREFILL_CASES = ["llama3_8b_prefill_t8192"]
MLA_CASES = [
    "deepseek_v3_h128_decode_b64_ctx4096", "deepseek_v3_h128_decode_b128_ctx4096",
    "deepseek_v3_h128_fp8_decode_b64_ctx4096", "deepseek_v3_h128_fp8_decode_b128_ctx4096",
]
# (block_m, block_n, num_warps, num_stages); splits from the heuristic unless a variant names them.
# The first plan of a list is also run with each forced split count in SPLITS; --quick runs the
# first three of each list. With the block table prefetched a plan of s stages keeps s - 1 KV
# tiles in flight, hence the deep pipelines; bf16 MLA fits 2 stages at 64 positions, 4 at 32
# (compiled for sm_90, Triton 3.6).
DECODE_PLANS = [(16, 128, 4, 3), (16, 128, 4, 2), (16, 64, 4, 4), (16, 64, 4, 3), (16, 128, 4, 4),
                (16, 32, 4, 4)]
PREFILL_PLANS = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
                 (64, 128, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2)]
MLA_PLANS = [(64, 32, 8, 3), (64, 32, 8, 4), (64, 64, 8, 2), (64, 16, 8, 4), (64, 64, 8, 3), (64, 128, 8, 1),
             (64, 32, 8, 2)]
SPLITS = [2, 4, 8, 16, 32, 64]


def _plan_fields(plan) -> dict:
    block_m, block_n, num_warps, num_stages = plan
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _time(fn, kwargs) -> float:
    return graph_replay_time(fn, [kwargs], calls_per_graph=4, trials=10).median_us


def _sdpa_peer(spec, kwargs) -> float | None:
    """Dense torch SDPA on the same logical problem (contiguous [B, H, L, D] KV, no paging)."""
    import torch.nn.functional as F

    if spec.name != "paged_attention" or kwargs["k_cache"].dtype == torch.float8_e4m3fn:
        return None
    q, kc = kwargs["query"], kwargs["k_cache"]
    batch = kwargs["seq_lens"].shape[0]
    length = kwargs["max_seq_len"]
    heads, kv_heads, dim = q.shape[1], kc.shape[2], q.shape[2]
    q_len = q.shape[0] // batch
    qd = q.view(batch, q_len, heads, dim).transpose(1, 2).contiguous()
    k = torch.randn(batch, kv_heads, length, dim, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)
    if q_len == 1:
        def fn(qd=qd, k=k, v=v):
            return F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
    else:
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)

        def fn(qd=qd, k=k, v=v):
            return F.scaled_dot_product_attention(qd, k, v, is_causal=True)
    return _time(lambda: fn(), {})


def parse_plan(text: str) -> dict:
    """``BMxBNxWxS[p][:SPLITS]`` as AttentionPlan fields: ``64x64x8x2:1``, or ``16x64x4x4p:4``
    with the block table prefetched (``prefetch_pages``)."""
    shape, _, splits = text.partition(":")
    prefetch = shape.endswith("p")
    fields = _plan_fields(tuple(int(x) for x in shape.removesuffix("p").split("x")))
    if prefetch:
        fields["prefetch_pages"] = True
    if splits:
        fields["num_splits"] = int(splits)
    return fields


def run(out_dir: str, ops: list[str], kinds: list[str], cases: list[str], quick: bool,
        budget_s: float, explicit_plans: list[dict] | None = None) -> None:
    began = time.time()
    device = torch.device("cuda")
    ceilings = ceilings_module.measure("cuda")
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v}, flush=True)
    groups = []
    if "paged_attention" in ops:
        groups += [(pa_spec, paged_attention, c, DECODE_PLANS, "decode") for c in DECODE_CASES]
        groups += [(pa_spec, paged_attention, c, PREFILL_PLANS, "prefill") for c in PREFILL_CASES]
    if "mla_decode" in ops:
        groups += [(mla_spec, mla_decode, c, MLA_PLANS, "mla") for c in MLA_CASES]
    groups = [g for g in groups if g[4] in kinds and (not cases or g[2] in cases)]
    rows = []
    record = {
        **records.header(),
        "ceilings": ceilings, "rows": rows,
    }
    os.makedirs(out_dir, exist_ok=True)
    for spec_module, fn, case_name, plans, kind in groups:
        if time.time() - began > budget_s:
            print(f"budget of {budget_s} s spent: {case_name} and later cases not run", flush=True)
            break
        spec = spec_module.SPEC
        kwargs = spec.case(case_name).build(device, 0)
        cost = spec.cost(kwargs)
        expected = spec.reference(**kwargs)
        torch.cuda.synchronize()
        mla = kind == "mla"
        q, cache = (kwargs["q"], kwargs["kv_cache"]) if mla else (kwargs["query"], kwargs["k_cache"])
        kv_heads = 1 if mla else cache.shape[2]
        default = _attention.plan_for(
            _attention.kind_for(kwargs["max_query_len"], cache.dtype, mla), device, kwargs["seq_lens"].shape[0],
            q.shape[0], q.shape[1] // kv_heads, kv_heads, kwargs["max_query_len"], kwargs["max_seq_len"],
            head_dim=q.shape[2])
        if explicit_plans:
            variants = [(fields, "named") for fields in explicit_plans]
        else:
            variants = [(_plan_fields(p), "") for p in (plans[:3] if quick else plans)]
        if kind != "prefill" and not quick and not explicit_plans:
            best_guess = _plan_fields(plans[0])
            variants += [(dict(best_guess, num_splits=s), "splits") for s in SPLITS]
        peer = _sdpa_peer(spec, kwargs)
        if peer is not None:
            rows.append(dict(op=spec.name, case=case_name, plan="torch SDPA (dense KV)", us=peer,
                             gbps=cost.bytes / peer / 1e3, tflops=cost.flops / peer / 1e6, status="peer"))
        for fields, tag in variants:
            started = time.time()
            row = dict(op=spec.name, case=case_name, plan=fields, default_splits=default.num_splits, tag=tag)
            try:
                with _attention.override_plan(**fields):
                    actual = fn(**kwargs)
                    spec.check_close(spec.outputs(actual, kwargs), spec.outputs(expected, kwargs), kwargs)
                    us = _time(fn, kwargs)
                row.update(us=us, gbps=cost.bytes / us / 1e3, tflops=cost.flops / us / 1e6, status="ok")
            except AssertionError as error:
                row.update(status="wrong", error=str(error)[:300])
            except Exception as error:  # noqa: BLE001 - out of resources etc.: record and go on
                row.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
            row["seconds"] = round(time.time() - started, 1)
            rows.append(row)
            pct = row.get("error")
            if "us" in row:
                pct = (f"{100 * row['gbps'] / ceilings['memory_gbps']:5.1f}% bw "
                       f"{100 * row['tflops'] / ceilings['bf16_tflops']:5.1f}% bf16")
            print(f"{case_name:42s} {str(fields):75s} {row.get('us', 0):9.1f} us {pct}", flush=True)
        for row in rows:
            if row["case"] == case_name and row["status"] == "peer":
                print(f"{case_name:42s} {'torch SDPA dense':75s} {row['us']:9.1f} us "
                      f"{100 * row['gbps'] / ceilings['memory_gbps']:5.1f}% bw "
                      f"{100 * row['tflops'] / ceilings['bf16_tflops']:5.1f}% bf16", flush=True)
        del kwargs, expected
        torch.cuda.empty_cache()
        with open(os.path.join(out_dir, f"attention_sweep_{'_'.join(kinds)}.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="perf-out")
    parser.add_argument("--ops", nargs="*", default=["paged_attention", "mla_decode"])
    parser.add_argument("--kinds", nargs="*", default=["decode", "prefill", "mla"])
    parser.add_argument("--cases", nargs="*", default=[], help="only these cases (default: all)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no case after this")
    parser.add_argument("--plans", nargs="*", default=[],
                        help="only these plans, BMxBNxWxS[p][:SPLITS] (e.g. 64x64x8x2:1; p: prefetch the "
                             "block table), for every case")
    args = parser.parse_args()
    run(args.out, args.ops, args.kinds, args.cases, args.quick, args.budget_s,
        [parse_plan(p) for p in args.plans] or None)


if __name__ == "__main__":
    main()
