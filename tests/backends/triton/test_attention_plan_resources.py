"""The attention plan tables against the GPUs they are chosen for, each plan compiled for its target
on the CPU: every plan fits the shared memory a program may take there, and the software pipeline
holds the KV tiles its stages promise (a plan edit that would not fit on the GPU fails here first)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kernelmux.backends.triton import _attention

pytest.importorskip("triton")
if platform.system() != "Linux" or platform.machine() != "x86_64":
    pytest.skip("Triton's bundled NVIDIA toolchain ships for Linux x86_64", allow_module_level=True)

# Shared memory a program may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin): Hopper 227 KB;
# sm_86, sm_89 and sm_120 99 KB (A100's 163 KB is above that).
LIMITS = {"_TABLE": 232448, "_COMPACT_TABLE": 101376}
TARGETS = ["90:_TABLE", "89:_COMPACT_TABLE", "80:_COMPACT_TABLE"]


@pytest.fixture(scope="module")
def report() -> list[dict]:
    # A process without TRITON_INTERPRET: the interpreter's kernels cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernelmux.perf.attention_resources", *TARGETS],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_plan_fits_shared_memory(report):
    rows = [r for r in report if r["table"] in LIMITS]
    expected = {(int(t.split(":")[0]), t.split(":")[1], kind) for t in TARGETS
                for kind in getattr(_attention, t.split(":")[1])
                if not (int(t.split(":")[0]) < 89 and kind.endswith("fp8"))}
    assert {(r["arch"], r["table"], r["kind"]) for r in rows} == expected
    over = [f"{r['table']}[{r['kind']!r}] on sm_{r['arch']}: {r['shared_kb']:.1f} KB"
            for r in rows if r["shared_kb"] * 1024 > LIMITS[r["table"]]]
    assert not over, "plans past the shared memory of their GPUs: " + "; ".join(over)


def test_table_prefetch_gives_the_pipeline_its_depth(report):
    # Three stages keep two KV tiles in flight beside the one in use only when the block-table
    # load is out of the pipeline's way (loaded a step ahead).
    buffers = {r["table"]: r["kv_buffers"] for r in report if r["table"].startswith("prefill 64x64x4x3")}
    assert buffers == {"prefill 64x64x4x3 prefetch=True": 3, "prefill 64x64x4x3 prefetch=False": 2}


def test_no_plan_claims_more_programs_per_sm_than_its_gpus_hold(report):
    # The split heuristic's wave is programs_per_sm on every SM: a plan claiming more than its
    # GPUs hold would under-split. The tables hold what Triton 3.6 (the device image) compiles
    # to; a newer Triton may fit more (Triton 3.9's ptxas takes the bf16 decode plan to 128
    # registers, three programs per SM), which only costs splits that were not needed.
    over = [f"{r['table']}[{r['kind']!r}] on sm_{r['arch']}: declares {r['programs_per_sm']}, "
            f"fits {r['fits_per_sm']} ({r['registers']} registers, {r['shared_kb']:.1f} KB)"
            for r in report if r["table"] in LIMITS and r["programs_per_sm"] > r["fits_per_sm"]]
    assert not over, "; ".join(over)
