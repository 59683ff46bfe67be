"""What a paged KV cache's layout lets any kernel read: the read bandwidth of the exact cache
blocks a decode case reads, in its block table's order, against the same bytes read in address
order and against a contiguous (unpaged) layout, as percents of the device-copy bandwidth
measured in the same run; then the cuda backend's fp8 decode kernel on the case's own table and
on a contiguous one. A chunk-size sweep (random chunks of 1-64 KiB over 192 MiB against the same
buffer read in order) shows how the read rate depends on the contiguous run a block holds:
Llama-3-70B at TP8 (one KV head) with an fp8 cache and 16-position blocks holds 2 KiB per block
and tensor, Llama-3-8B (eight KV heads) 16 KiB.

The probe reads with a Triton kernel, K and V in one launch as a decode call reads them: each
program gathers R rows (chunks) of one tensor with 16-byte loads, 32 KiB a program, and stores
one int (a sum, so the loads are not dead). Every timing is CUDA-graph replay over input sets
spanning three times the L2, as the bench times.

    python perf/diag/paged_read_probe.py --out DIR [--cases NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kernelmux.backends.cuda import _paged_decode
from kernelmux.backends.cuda import paged_attention as cuda_paged_attention
from kernelmux.specs import paged_attention as pa_spec
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf import records
from kernelmux.perf.timing import checked_replay_time, graph_replay_time, rotation_count

CASES = ["llama3_70b_tp8_fp8_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b8_ctx32768",
         "llama3_8b_fp8_decode_b64_ctx4096"]
PROGRAM_BYTES = 32 * 1024


@triton.jit
def _read_rows(first, second, rows, out, PROGRAMS, ROW_INTS: tl.constexpr, R: tl.constexpr):
    # Programs 0 .. PROGRAMS - 1 read `first`, the rest the same rows of `second` (a decode call's
    # K and V in one launch).
    pid = tl.program_id(0)
    part = pid % PROGRAMS
    row = tl.load(rows + part * R + tl.arange(0, R)).to(tl.int64)
    offsets = row[:, None] * ROW_INTS + tl.arange(0, ROW_INTS)[None, :]
    if pid < PROGRAMS:
        x = tl.load(first + offsets)
    else:
        x = tl.load(second + offsets)
    tl.store(out + pid, tl.sum(tl.sum(x, axis=1), axis=0))


def read_rows(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """Read rows ``rows`` of the int32 matrices ``first`` and ``second`` in one launch
    (``len(rows)`` a multiple of R; ``out`` holds two ints per R rows)."""
    row_ints = first.shape[1]
    r = max(1, PROGRAM_BYTES // (4 * row_ints))
    programs = rows.numel() // r
    _read_rows[(2 * programs,)](first, second, rows, out, programs, ROW_INTS=row_ints, R=r, num_warps=4)


def read_gbps(pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> float:
    """Bytes of ``rows`` of both tensors of a pair over the replayed time of one launch reading
    them, GB/s; the graph cycles through the pairs."""
    out = torch.empty(2 * rows.numel(), dtype=torch.int32, device=rows.device)
    nbytes = 2 * rows.numel() * pairs[0][0].shape[1] * 4
    return nbytes / graph_replay_time(read_rows, [{"first": a, "second": b, "rows": rows, "out": out}
                                                  for a, b in pairs],
                                      calls_per_graph=8, trials=10).median_us / 1e3


def chunk_sweep(copy_gbps: float, l2_bytes: int) -> list[dict]:
    """Random chunk order against address order, per chunk size, over 3x the L2 or more."""
    total = max(192 << 20, 3 * l2_bytes)
    buffer = torch.randint(-1000, 1000, (total // 4,), dtype=torch.int32, device="cuda")
    found = []
    for chunk in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
        halves = buffer.view(2, -1, chunk // 4)
        ordered = torch.arange(halves.shape[1], device="cuda", dtype=torch.int32)
        shuffled = ordered[torch.randperm(halves.shape[1], device="cuda")]
        row = {"chunk_bytes": chunk}
        for name, rows in (("in_order", ordered), ("random", shuffled)):
            gbps = read_gbps([(halves[0], halves[1])], rows)
            row[name] = {"gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / copy_gbps, 1)}
        found.append(row)
        print(f"chunk {chunk:6d} B: in order {row['in_order']['pct_of_copy']:5.1f}%, "
              f"random {row['random']['pct_of_copy']:5.1f}% of copy", flush=True)
    return found


def _blocks_read(kwargs: dict) -> torch.Tensor:
    """The cache blocks a decode call reads, sequence by sequence in table order."""
    block_size = kwargs["k_cache"].shape[1]
    lengths = kwargs["seq_lens"].tolist()
    table = kwargs["block_table"]
    return torch.cat([table[b, : -(-n // block_size)] for b, n in enumerate(lengths)])


def _contiguous(kwargs: dict) -> dict:
    """The case with each sequence's blocks consecutive in memory, in order (its table becomes
    arange rows); the cache contents stay random, so the reference is recomputed."""
    block_size = kwargs["k_cache"].shape[1]
    per_seq = -(-int(kwargs["seq_lens"].max()) // block_size)
    batch = kwargs["seq_lens"].shape[0]
    needed = batch * per_seq
    changed = dict(kwargs)
    for name in ("k_cache", "v_cache"):
        cache = kwargs[name]
        if cache.shape[0] < needed:
            cache = torch.cat([cache, cache[: needed - cache.shape[0]]])
        changed[name] = cache
    changed["block_table"] = torch.arange(needed, dtype=torch.int32, device=kwargs["block_table"].device).view(
        batch, per_seq)
    return changed


def case_rows(case: str, copy_gbps: float, l2_bytes: int) -> dict:
    kwargs = pa_spec.SPEC.case(case).build(torch.device("cuda"), 0)
    cost = pa_spec.SPEC.cost(kwargs)
    block_bytes = kwargs["k_cache"][0].numel()  # e4m3: one byte an element
    sets = rotation_count(2 * kwargs["k_cache"].numel(), l2_bytes, 8)
    found = {"case": case, "block_bytes": block_bytes, "input_sets": sets}

    # The probe: the same blocks, the same order, 16-byte loads and nothing else.
    caches = tuple(kwargs[name].view(torch.int32).view(kwargs[name].shape[0], -1) for name in ("k_cache", "v_cache"))
    pairs = [caches] + [tuple(c.clone() for c in caches) for _ in range(sets - 1)]
    blocks = _blocks_read(kwargs)
    r = max(1, PROGRAM_BYTES // block_bytes)
    if blocks.numel() % r:
        blocks = torch.cat([blocks, blocks[: r - blocks.numel() % r]])
    for name, rows in (("table_order", blocks), ("address_order", blocks.sort().values),
                       ("contiguous", torch.arange(blocks.numel(), device="cuda", dtype=torch.int32)
                        % caches[0].shape[0])):
        gbps = read_gbps(pairs, rows.to(torch.int32).contiguous())
        found[f"probe_{name}"] = {"gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / copy_gbps, 1)}
    del pairs

    # The kernel, on the case's table and on a contiguous one (its own reference each).
    for layout, base in (("table", kwargs), ("contiguous", _contiguous(kwargs))):
        inputs = [base] + [{**base, "k_cache": base["k_cache"].clone(), "v_cache": base["v_cache"].clone()}
                           for _ in range(sets - 1)]
        expected = pa_spec.SPEC.reference(**base)
        for plan in ({}, {"warps": 16, "num_splits": 1}):
            with _paged_decode.override_plan(**plan):
                us = checked_replay_time(cuda_paged_attention.paged_attention, inputs, expected,
                                         pa_spec.SPEC.check_close, calls_per_graph=8, trials=10).median_us
            key = f"kernel_{layout}_" + ("default" if not plan else "w16s1")
            found[key] = {"us": round(us, 2), "pct_of_copy": round(100 * cost.bytes / us / 1e3 / copy_gbps, 1)}
        del inputs, expected
    print(json.dumps(found), flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=CASES)
    args = parser.parse_args()
    ceilings = ceilings_module.measure("cuda", only=("memory_gbps",))
    copy = ceilings["memory_gbps"]
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy bandwidth {copy:.1f} GB/s, L2 {l2_bytes >> 20} MiB", flush=True)
    record = {**records.header(), "ceilings": ceilings, "chunks": chunk_sweep(copy, l2_bytes), "cases": []}
    os.makedirs(args.out, exist_ok=True)
    for case in args.cases:
        record["cases"].append(case_rows(case, copy, l2_bytes))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "paged_read_probe.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
