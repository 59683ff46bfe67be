"""Compile the triton backend's attention plans for an NVIDIA target without a GPU and read what
they take: shared memory, registers, spills and pipelined KV buffers (perf/diag/attention_compile_cost.py
and tests/backends/triton/test_attention_plan_resources.py use it)."""

# Triton's compiler and its bundled ptxas run on any Linux x86_64 host. The KV buffers are the
# leading dim of the multi-buffered allocations in the TTGIR (1: a tile is loaded and waited for
# in the same step). Pointer and stride arguments are marked 16-divisible, as Triton's launcher
# specializes them on the GPU: without that the loads are not vectorized and not pipelined.

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself uses for the arch
from triton.compiler import ASTSource

from kernelmux.backends.triton import _attention
from kernelmux.backends.triton import _attention_kernel as K

FN = K.paged_attention_kernel

# A shape per kind: Llama-3-8B (32 / 8 heads, D 128, block 16) for decode and prefill, Llama-3-70B
# TP8 with a split fp8 cache for decode_fp8, DeepSeek-V3 (128 heads, 512 + 64, block 64) for MLA.
_COMMON = dict(
    NUM_Q_HEADS=32, GROUP=4, D_MAIN=128, D_ROPE=0, BLOCK_D=128, BLOCK_R=1, BLOCK_SIZE=16,
    ONE_QUERY_PER_SEQ=True, CAUSAL=True, WINDOW=False, SOFT_CAP=False, HAS_SINKS=False, HAS_K_SCALE=False,
    HAS_V_SCALE=False, V_FROM_K=False, RETURN_LSE=False, SPLIT_KV=False, DOT_FP32=False, DOT_FP16=False,
)
_MLA = dict(NUM_Q_HEADS=128, GROUP=128, D_MAIN=512, D_ROPE=64, BLOCK_D=512, BLOCK_R=64, BLOCK_SIZE=64,
            V_FROM_K=True, RETURN_LSE=True, SPLIT_KV=True)
SHAPES = {  # kind: (query dtype, cache dtype, constexprs beyond _COMMON)
    "decode": ("bf16", "bf16", {}),
    "decode_fp8": ("bf16", "fp8e4nv", dict(NUM_Q_HEADS=8, GROUP=8, SPLIT_KV=True, DOT_FP16=True,
                                           HAS_K_SCALE=True, HAS_V_SCALE=True)),
    "prefill": ("bf16", "bf16", dict(ONE_QUERY_PER_SEQ=False)),
    "prefill_large": ("bf16", "bf16", dict(ONE_QUERY_PER_SEQ=False)),
    "mla": ("bf16", "bf16", _MLA),
    "mla_fp8": ("bf16", "fp8e4nv", dict(_MLA, DOT_FP16=True, HAS_K_SCALE=True)),
}
_POINTERS = {"q_ptr": "q", "k_ptr": "kv", "v_ptr": "kv", "out_ptr": "q", "lse_ptr": "fp32",
             "part_acc_ptr": "fp32", "part_ml_ptr": "fp32", "cu_q_ptr": "i32", "block_table_ptr": "i32",
             "seq_lens_ptr": "i32", "sinks_ptr": "fp32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}


def compile_plan(kind: str, plan: _attention.AttentionPlan, arch: int):
    """(seconds, compiled kernel) for ``plan`` on ``kind``'s shape (SHAPES), for sm_<arch>."""
    q_dtype, kv_dtype, extra = SHAPES[kind]
    consts = dict(_COMMON, **extra)
    heads_per_tile = min(consts["GROUP"], plan.block_m)
    consts.update(HEADS_PER_TILE=heads_per_tile, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                  PREFETCH_PAGES=plan.prefetch_pages)
    signature, attrs = {}, {}
    for index, name in enumerate(FN.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in _POINTERS:
            kind_of = _POINTERS[name]
            signature[name] = "*" + {"q": q_dtype, "kv": kv_dtype}.get(kind_of, kind_of)
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "soft_cap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=FN, signature=signature, constexprs=consts, attrs=attrs)
    began = time.time()
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    return time.time() - began, kernel


def resources(kernel, arch: int) -> dict:
    """Shared memory, registers, spill bytes and pipelined KV tiles of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        target = f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}"
        report = subprocess.run([get_ptxas(arch).path, target, "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True).stderr
    registers = re.findall(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill stores", report)
    if not registers:
        raise RuntimeError(f"ptxas for sm_{arch} reported no register count:\n{report[-2000:]}")
    buffers = [int(n) for n in re.findall(r"memdesc<(\d+)x\d+x\d+x", kernel.asm["ttgir"])]
    return dict(shared_kb=kernel.metadata.shared / 1024, registers=int(registers[0]),
                spill_bytes=int(spills[0]) if spills else 0, kv_buffers=max(buffers, default=0))


# Per SM: 64K 32-bit registers (allocated per warp in units of 256) and this much shared memory
# (KB; each program also takes 1 KB that the driver reserves).
_REGISTERS_PER_SM = 65536
_SHARED_KB_PER_SM = {80: 164, 86: 100, 89: 100, 90: 228, 100: 228, 120: 100}


def programs_per_sm(registers: int, shared_kb: float, num_warps: int, arch: int) -> int:
    """How many programs of a compiled plan an SM of ``arch`` holds at once."""
    warp_registers = -(-registers * 32 // 256) * 256
    by_registers = _REGISTERS_PER_SM // (warp_registers * num_warps)
    by_shared = int(_SHARED_KB_PER_SM[arch] // (shared_kb + 1))
    return min(by_registers, by_shared)


def table_report(targets: list[tuple[int, str]]) -> list[dict]:
    """resources() of every plan of each (arch, table name) with the programs an SM holds
    (``fits_per_sm``) and the plan's own ``programs_per_sm``, fp8 plans skipped below sm_89 (no
    e4m3 in Triton there), plus the pipeline buffers of the 64 x 64, 3-stage prefill plan with
    and without the table prefetch."""
    rows = []
    for arch, table in targets:
        for kind, plan in getattr(_attention, table).items():
            if arch < 89 and kind.endswith("fp8"):
                continue
            _, kernel = compile_plan(kind, plan, arch)
            row = dict(arch=arch, table=table, kind=kind, **resources(kernel, arch))
            row["fits_per_sm"] = programs_per_sm(row["registers"], row["shared_kb"], plan.num_warps, arch)
            rows.append(dict(row, programs_per_sm=plan.programs_per_sm))
    for prefetch in (True, False):
        plan = _attention.AttentionPlan(block_m=64, block_n=64, num_warps=4, num_stages=3,
                                       prefetch_pages=prefetch)
        _, kernel = compile_plan("prefill", plan, 90)
        rows.append(dict(arch=90, table=f"prefill 64x64x4x3 prefetch={prefetch}", kind="prefill",
                         **resources(kernel, 90)))
    return rows


if __name__ == "__main__":
    # python -m kernelmux.perf.attention_resources ARCH:TABLE ...  -> JSON rows on stdout. Run as a
    # process of its own where TRITON_INTERPRET=1 is set (the tests): the interpreter's kernels
    # cannot be compiled.
    import json
    import sys

    print(json.dumps(table_report([(int(a), t) for a, t in (x.split(":") for x in sys.argv[1:])])))
