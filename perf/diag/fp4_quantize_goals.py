"""Issue 32's quantize goal shapes: quantize_nvfp4 (dynamic and passed-in global scale) and quantize_mxfp4 (floor)
at T in {1, 128, 4096} x H in {2880, 7168}, bf16 activations, on the GPU. Each implementation that serves a call
(the reference and every backend the engine finds viable: triton, and on Hopper cuda's kernel beside it) is
checked bit for bit against the reference,
then timed by CUDA-graph replay over four inputs; times are set against the copy bandwidth measured in the same
run (the spec's bytes: x read once, codes and scales written). --tiles times the triton kernels with ROWS rows
by BLOCK_K columns a program at every T.

    python perf/diag/fp4_quantize_goals.py --out DIR [--tokens 1 128 4096] [--hidden 2880 7168]
        [--tiles ROWSxBLOCK_K ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from unittest import mock

import torch

from kernelmux import engine as engines
from kernelmux.backends.triton import quantize_mxfp4 as triton_mx
from kernelmux.backends.triton import quantize_nvfp4 as triton_nv
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import sized_replay_time
from kernelmux.specs import quantize_mxfp4, quantize_nvfp4

VARIANTS = {  # name -> (spec module, fixed kwargs)
    "nvfp4": (quantize_nvfp4, {}),
    "nvfp4_static": (quantize_nvfp4, {"global_scale": 2688.0 / 20.0}),
    "mxfp4": (quantize_mxfp4, {"rounding": "floor"}),
}
INPUTS = 4


def _inputs(variant: str, tokens: int, hidden: int) -> list[dict]:
    gen = torch.Generator("cuda").manual_seed(tokens * 7 + hidden)
    extra = dict(VARIANTS[variant][1])
    if "global_scale" in extra:
        extra["global_scale"] = torch.tensor(extra["global_scale"], device="cuda")
    return [dict(x=torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16) * 3, **extra)
            for _ in range(INPUTS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 128, 4096])
    parser.add_argument("--hidden", nargs="*", type=int, default=[2880, 7168])
    parser.add_argument("--tiles", nargs="*", default=[], metavar="ROWSxBLOCK_K")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps",))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    engine = engines.current()
    rows = []
    for variant, (module, _) in VARIANTS.items():
        spec = module.SPEC
        for hidden in args.hidden:
            for tokens in args.tokens:
                inputs = _inputs(variant, tokens, hidden)
                expected = spec.reference(**inputs[0])
                cost = spec.cost(inputs[0])
                impls = {"reference": spec.reference}
                impls.update((impl.backend, impl.fn) for impl, reason in engine.explain(spec.name, inputs[0])
                             if reason is None)
                host = triton_nv if module is quantize_nvfp4 else triton_mx
                timed = [(name, fn, None) for name, fn in impls.items()]
                timed += [("triton", impls["triton"], tile) for tile in args.tiles if "triton" in impls]
                for name, fn, tile in timed:
                    row = dict(variant=variant, tokens=tokens, hidden=hidden, impl=name, tiles=tile or "default")
                    try:
                        with contextlib.ExitStack() as stack:
                            if tile:
                                block_rows, block_k = (int(v) for v in tile.split("x"))
                                stack.enter_context(mock.patch.object(host, "ROWS", block_rows))
                                stack.enter_context(mock.patch.object(host, "BLOCK_K", block_k))
                                stack.enter_context(mock.patch.object(host, "PROGRAM_ROWS_FROM", 1))
                            spec.check_close(fn(**inputs[0]), expected, inputs[0])
                            us = sized_replay_time(fn, inputs, max_calls=64)
                        row.update(us=round(us, 2), copy_pct=round(100 * cost.bytes / (us * 1e-6)
                                                                   / (ceilings["memory_gbps"] * 1e9), 1))
                    except Exception as error:  # noqa: BLE001 - a failing implementation is a finding
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(os.path.join(args.out, "fp4_quantize_goals.json"), "w") as f:
                        json.dump(dict(ceilings=ceilings, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
