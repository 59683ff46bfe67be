"""Issue 32's W4A16 goal shapes for fp4_mm on the GPU: N x K in {8192 x 8192, 2880 x 2880, 7168 x 2048,
2048 x 7168}, M in {1, 4, 16, 256, 4096}, NVFP4 and MXFP4 weights (random codes, scales in a trained layer's
range), bf16 activations. The triton backend's call as served, the other side of its DEQUANTIZE_MIN_ROWS (from 16
rows: the weights decoded for torch's GEMM, or the tensor-core tiles), and under other launch configurations
(--gemv-tiles for the GEMVs, --tiles for the tensor-core GEMM, each at every M), and on Hopper the cuda
backend's GEMV (M <= its MAX_ROWS; as served, and at each of --cuda-warps warps a CTA), is checked against the spec's
reference, then timed by CUDA-graph replay over four inputs; times are set against the copy bandwidth (the
weight and scale bytes, M <= 16) and the bf16 matmul rate (M >= 256) measured in the same run, and beside
torch's bf16 GEMM on the dequantized weights.

    python perf/diag/fp4_mm_goals.py --out DIR [--formats nvfp4 mxfp4] [--rows 1 4 16 256 4096]
        [--shapes 8192x8192 ...] [--gemv-tiles BNxBKxWARPSxSTAGES ...] [--tiles BMxBNxBKxWARPSxSTAGES ...]
        [--cuda-warps 4 8 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from unittest import mock

import torch

from kernelmux.backends.cuda import fp4_mm as cuda_fp4
from kernelmux.backends.triton import fp4_mm as triton_fp4
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import sized_replay_time
from kernelmux.specs import fp4_mm as spec

SHAPES = ("8192x8192", "2880x2880", "7168x2048", "2048x7168")
INPUTS = 4


def _weights(fmt: str, n: int, k: int, gen: torch.Generator) -> dict:
    block = spec.BLOCKS[fmt]
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    if fmt == "mxfp4":  # e8m0 2^-9..2^-5
        scale = torch.randint(118, 123, (n, k // block), dtype=torch.uint8, device="cuda", generator=gen)
        return dict(b=b, b_scale=scale, fmt=fmt)
    scale = (torch.rand(n, k // block, device="cuda", generator=gen) * 400 + 16).to(torch.float8_e4m3fn)
    return dict(b=b, b_scale=scale, fmt=fmt, b_global_scale=torch.tensor(2688.0 / 4.0, device="cuda"))


def _variants(rows: int, gemv_tiles: list[str], tiles: list[str]) -> list[tuple[str, list]]:
    """(name, patches (module, attribute, value) of the triton host module) for the call as served and each
    configuration asked for that fits the size: GEMVs up to 16 rows, 16-row tiles up to 16 rows and wider ones
    from 64."""
    out = [("default", [])]
    never = (triton_fp4, "DEQUANTIZE_MIN_ROWS", 1 << 30)
    if rows >= 16:
        out.append(("tiles, not dequantized", [never]) if rows >= triton_fp4.DEQUANTIZE_MIN_ROWS else
                   ("dequantized", [(triton_fp4, "GEMV_MAX_ROWS", 0), (triton_fp4, "DEQUANTIZE_MIN_ROWS", 0)]))
    for text in gemv_tiles if rows <= 16 else ():
        n, k, w, s = (int(v) for v in text.split("x"))
        out.append((f"gemv {text}", [(triton_fp4, "GEMV_MAX_ROWS", 1 << 30),
                                      (triton_fp4, "gemv_tile", lambda _n, _k, t=(n, k, w, s): t)]))
    for text in tiles:
        m, n, k, w, s = (int(v) for v in text.split("x"))
        if (m <= 16) != (rows <= 16):
            continue
        config = triton_fp4.Tiles(m, n, k, 8 if m > 16 else 1, w, s)
        out.append((f"tiles {text}", [(triton_fp4, "GEMV_MAX_ROWS", 0), never,
                                        (triton_fp4, "tiles_for", lambda _rows, c=config: c)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", nargs="*", default=["nvfp4", "mxfp4"])
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 4, 16, 256, 4096])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--gemv-tiles", nargs="*", default=[])
    parser.add_argument("--tiles", nargs="*", default=[])
    parser.add_argument("--cuda-warps", nargs="*", type=int, default=[])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps", "bf16_tflops"))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    rows_out = []
    for fmt in args.formats:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            gen = torch.Generator("cuda").manual_seed(n + k)
            weights = _weights(fmt, n, k, gen)
            dense = spec.dequantize_fp4(weights["b"], weights["b_scale"], fmt,
                                        weights.get("b_global_scale")).to(torch.bfloat16)
            weight_bytes = weights["b"].numel() + weights["b_scale"].numel()
            for rows in args.rows:
                inputs = [dict(a=torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16), **weights)
                          for _ in range(INPUTS)]
                expected = spec.fp4_mm(**inputs[0])
                flops = 2 * rows * n * k

                def torch_bf16(a, **_):
                    return a @ dense.T

                timed = [("torch bf16 (dequantized)", torch_bf16, [])]
                timed += [(f"triton {name}", triton_fp4.fp4_mm, patches)
                          for name, patches in _variants(rows, args.gemv_tiles, args.tiles)]
                if rows <= cuda_fp4.MAX_ROWS and torch.cuda.get_device_capability() == cuda_fp4.CAPABILITY:
                    timed.append(("cuda", cuda_fp4.fp4_mm, []))
                    timed += [(f"cuda {w} warps", cuda_fp4.fp4_mm, [(cuda_fp4, "warps_for", lambda *_, w=w: w)])
                              for w in args.cuda_warps]
                for name, fn, patches in timed:
                    row = dict(fmt=fmt, shape=shape, rows=rows, impl=name)
                    try:
                        with contextlib.ExitStack() as stack:
                            for module, attr, value in patches:
                                stack.enter_context(mock.patch.object(module, attr, value))
                            if fn is not torch_bf16:
                                spec.check_close(fn(**inputs[0]), expected, inputs[0])
                            us = sized_replay_time(fn, inputs, max_calls=64)
                        row.update(us=round(us, 2),
                                   weight_copy_pct=round(100 * weight_bytes / (us * 1e-6)
                                                         / (ceilings["memory_gbps"] * 1e9), 1),
                                   bf16_rate_pct=round(100 * flops / (us * 1e-6) / (ceilings["bf16_tflops"] * 1e12), 1))
                    except Exception as error:  # noqa: BLE001 - a failing variant is a finding
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
                    with open(os.path.join(args.out, "fp4_mm_goals.json"), "w") as f:
                        json.dump(dict(ceilings=ceilings, rows=rows_out), f, indent=1)
                del inputs, expected
            dense = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
