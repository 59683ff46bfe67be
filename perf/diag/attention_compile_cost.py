"""First-call cost and GPU resources of the triton backend's attention plans, without a GPU: each
plan of _attention._TABLE (or another table) compiled for an NVIDIA target in a fresh cache, with
kernelmux.perf.attention_resources' reading (shared memory, registers, spills, KV buffers)."""

#     python perf/diag/attention_compile_cost.py [--arch 90] [--table _COMPACT_TABLE] [--kinds prefill_large]
#
# Triton compiles paged_attention_kernel once per constexpr set (dtypes, head geometry, cache block
# size, options, plan), then keeps the binary in its on-disk cache (~/.triton/cache) for later
# processes. Compile times depend on the host; the resources do not.

from __future__ import annotations

import argparse
import os
import tempfile

# A fresh cache, so every plan is compiled (Triton reads this when it compiles).
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attention_compile_cost_")

import triton  # noqa: E402

from kernelmux.backends.triton import _attention  # noqa: E402
from kernelmux.perf.attention_resources import compile_plan, resources  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 89, 80")
    parser.add_argument("--table", default="_TABLE", help="_attention._TABLE or _COMPACT_TABLE")
    parser.add_argument("--kinds", nargs="*", default=None, help="default: every kind of the table")
    args = parser.parse_args()
    table = getattr(_attention, args.table)
    print(f"Triton {triton.__version__}, sm_{args.arch}, _attention.{args.table}", flush=True)
    for kind in args.kinds or list(table):
        plan = table[kind]
        seconds, kernel = compile_plan(kind, plan, args.arch)
        r = resources(kernel, args.arch)
        label = (f"{plan.block_m}x{plan.block_n} w{plan.num_warps} s{plan.num_stages}"
                 + (" prefetch" if plan.prefetch_pages else ""))
        print(f"{kind:14s} {label:26s} compile {seconds:5.2f} s  shared {r['shared_kb']:6.1f} KB  "
              f"registers {r['registers']}  spills {r['spill_bytes']} B  "
              f"pipeline buffers {r['kv_buffers']}", flush=True)


if __name__ == "__main__":
    main()
