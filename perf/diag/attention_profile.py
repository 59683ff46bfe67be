"""One call of a backend's paged_attention / mla_decode per named case for Nsight Compute: each
case is run once outside the profiled range (Triton compiles there), then once between
cudaProfilerStart and cudaProfilerStop. Without ncu it only runs the calls."""

#     ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
#         python perf/diag/attention_profile.py --cases llama3_8b_prefill_t8192 ...
#
# (perf/run_gpu.sh's profile-attention step runs it this way.)

from __future__ import annotations

import argparse
import contextlib
import importlib

import torch
from attention_sweep import parse_plan  # this folder: on sys.path when run as a script

from kernelmux.backends.triton import _attention
from kernelmux.specs import mla_decode as mla_spec
from kernelmux.specs import paged_attention as pa_spec

DEFAULT_CASES = [
    "llama3_8b_decode_b64_ctx4096", "llama3_70b_tp8_fp8_decode_b64_ctx4096", "llama3_8b_prefill_t8192",
    "deepseek_v3_h128_decode_b64_ctx4096", "deepseek_v3_h128_fp8_decode_b64_ctx4096",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--plan", help="BMxBNxWxS[p][:SPLITS] for every case instead of the table's")
    parser.add_argument("--backend", choices=("triton", "cuda"), default="triton")
    args = parser.parse_args()
    plan = _attention.override_plan(**parse_plan(args.plan)) if args.plan else contextlib.nullcontext()
    with plan:
        _profile(args.cases, args.backend)


def case_call(name: str, device: torch.device, backend: str = "triton"):
    """(the backend's function, its kwargs) for a named paged_attention or mla_decode case (the
    DeepSeek cases are MLA's); ``backend`` "triton" or "cuda" (fp8 paged-attention decode, Hopper
    MLA decode), whose entry for the op is ``backends/<backend>/<op>.py``."""
    spec = (mla_spec if name.startswith("deepseek") else pa_spec).SPEC
    entry = importlib.import_module(f"kernelmux.backends.{backend}.{spec.name}")
    return getattr(entry, spec.name), spec.case(name).build(device, 0)


def _profile(cases: list[str], backend: str) -> None:
    device = torch.device("cuda")
    calls = []
    for name in cases:
        fn, kwargs = case_call(name, device, backend)
        fn(**kwargs)  # compile outside the profiled range
        calls.append((name, fn, kwargs))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn, kwargs in calls:
        torch.cuda.nvtx.range_push(name)
        fn(**kwargs)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(name for name, _, _ in calls))


if __name__ == "__main__":
    main()
