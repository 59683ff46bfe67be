"""Issue 29's goal shapes for scaled_mm, built on the device: DeepSeek-V3-style block-scaled GEMMs (1 x 128
activation groups, 128 x 128 weight blocks, bf16 out) with N x K in {7168 x 16384, 2048 x 7168, 7168 x 2048,
36864 x 7168} at M in {1, 16, 64, 128} and {7168 x 16384, 36864 x 7168} at M = 4096. Every implementation
that serves a shape is timed by CUDA-graph replay, after its output is compared with the spec's reference
computed on the GPU (the largest difference relative to the largest output): the triton backend under
its own launch configuration (and with --sweep, each of _sweep's), on Hopper the cuda backend's GEMM at
M >= its MIN_ROWS, and as peers the torch backend (cuBLASLt), the deepgemm backend as served (its
scale-layout conversion included) and DeepGEMM's kernel alone on scales prepared once
("deepgemm-kernel"). Decode shapes cycle through enough weight copies that each call reads its weights
from HBM, not L2. Times are set against the copy bandwidth (for the weight bytes) and the fp8 matmul
rate measured in the same run.

    python perf/diag/scaled_mm_goals.py --out DIR [--m 1 16 64 128 4096] [--nk 7168x16384 ...] [--sweep]
        [--impls triton cuda torch deepgemm deepgemm-kernel] [--configs BM/BN/BK/WARPS/STAGES/SPLIT ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

from kernelmux.backends.cuda import scaled_mm as cuda_mm
from kernelmux.backends.triton import scaled_mm as triton_mm
from kernelmux.backends.triton.scaled_mm import AUTO, LaunchConfig
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import sized_replay_time
from kernelmux.specs import scaled_mm as spec
from kernelmux.specs.quantize_fp8 import quantize_fp8

DECODE_NK = ((7168, 16384), (2048, 7168), (7168, 2048), (36864, 7168))
PREFILL_NK = ((7168, 16384), (36864, 7168))
COLD_BYTES = 256 << 20  # decode: weight copies cycled until they pass this (5x an H200's L2)


def _sweep(rows: int) -> list[LaunchConfig]:
    """Decode (M <= 128): one row tile where it fits (16-64 rows), 32-128 wide column tiles, whole K or
    split-K (auto and 2-8 slices), 3-5 stages; 128-row tiles at M 128. Prefill: 64- and 128-row tiles,
    128-256 wide, 4 or 8 warps, 3 or 4 stages."""
    configs = []
    if rows <= 128:
        block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
        for block_n in (32, 64, 128):
            for split in (AUTO, 1):
                configs.append(LaunchConfig(block_m, block_n, 128, 1, 4, 4, split))
        for split in (2, 4, 8):
            configs.append(LaunchConfig(block_m, 64, 128, 1, 4, 4, split))
        configs += [LaunchConfig(block_m, 64, 128, 1, 4, 3, AUTO), LaunchConfig(block_m, 64, 128, 1, 4, 5, AUTO),
                    LaunchConfig(block_m, 64, 64, 1, 4, 6, AUTO), LaunchConfig(block_m, 128, 128, 1, 8, 4, AUTO)]
        if rows > 64:
            configs += [LaunchConfig(128, 64, 128, 8, 8, 3, AUTO), LaunchConfig(128, 128, 128, 8, 8, 3, AUTO)]
        return configs
    for block_m, block_n, warps, stages in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 8, 3),
                                            (128, 128, 4, 4), (64, 128, 4, 4)):
        configs.append(LaunchConfig(block_m, block_n, 128, 8, warps, stages, 1))
    return configs


def _parse_config(text: str) -> LaunchConfig:
    """BM/BN/BK/WARPS/STAGES/SPLIT (SPLIT 0: auto) -> the configuration (group_m 8, 1 at one row tile)."""
    block_m, block_n, block_k, warps, stages, split = (int(v) for v in text.split("/"))
    return LaunchConfig(block_m, block_n, block_k, 1 if block_m <= 64 else 8, warps, stages, split)


def _build(rows: int, cols: int, depth: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator("cuda").manual_seed(seed)
    copies = max(1, min(16, -(-COLD_BYTES // (cols * depth)))) if rows <= 128 else 1
    sets = []
    for _ in range(copies):
        w = torch.randn(cols, depth, device="cuda", generator=gen) / depth**0.5
        b, scale_b = spec.quantize_weight_blocks(w)
        del w
        x = torch.randn(rows, depth, device="cuda", generator=gen).to(torch.bfloat16)
        a, scale_a = quantize_fp8(x, "per_group", spec.BLOCK, False, "e4m3fn")
        sets.append(dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype="bfloat16", bias=None))
    return sets


def _peers() -> dict:
    from kernelmux.backends.torch import scaled_mm as torch_mm

    impls = {"triton": triton_mm.scaled_mm, "torch": torch_mm.scaled_mm}
    if torch.cuda.get_device_capability() == cuda_mm.CAPABILITY:
        impls["cuda"] = cuda_mm.scaled_mm
    try:
        import deep_gemm

        from kernelmux.backends.deepgemm import scaled_mm as deepgemm_mm

        impls["deepgemm"] = deepgemm_mm.scaled_mm
        prepared = {}

        def kernel_only(a, b, scale_a, scale_b, out_dtype, bias):
            """DeepGEMM's kernel on scales converted once per input set (as a served weight's would be)."""
            m, k = a.shape
            n = b.shape[0]
            key = (scale_a.data_ptr(), scale_b.data_ptr(), m, n, k)  # freed inputs' addresses come back
            if key not in prepared:
                prepared[key] = deepgemm_mm.prepare_scales(scale_a, scale_b, m, n, k)
            sfa, sfb = prepared[key]
            out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
            deep_gemm.fp8_gemm_nt(a=(a, sfa), b=(b, sfb), d=out, c=None, recipe=deepgemm_mm.RECIPE, compiled_dims="nk")
            return out

        impls["deepgemm-kernel"] = kernel_only
    except Exception as error:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        print(f"deepgemm peer unavailable: {type(error).__name__}: {error}")
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--m", nargs="*", type=int, default=[1, 16, 64, 128, 4096])
    parser.add_argument("--nk", nargs="*", default=None, help="NxK shapes (default: the goal's per M)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--configs", nargs="*", default=[], metavar="BM/BN/BK/WARPS/STAGES/SPLIT")
    parser.add_argument("--impls", nargs="*", default=None, help="time only these (default: all)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps", "fp8_tflops"))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    impls = _peers()
    rows_out = []
    for rows in args.m:
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.nk] if args.nk
                  else DECODE_NK if rows <= 128 else PREFILL_NK)
        for cols, depth in shapes:
            inputs = _build(rows, cols, depth)
            expected = spec.scaled_mm(**inputs[0]).float()
            scale = expected.abs().max().item()
            weight_bytes = cols * depth + inputs[0]["scale_b"].numel() * 4
            flops = 2 * rows * cols * depth
            floor_us = max(flops / (ceilings["fp8_tflops"] * 1e12),
                           weight_bytes / (ceilings["memory_gbps"] * 1e9)) * 1e6
            variants = [(name, fn, None) for name, fn in impls.items() if (args.impls is None or name in args.impls)
                        and (name != "cuda" or rows >= cuda_mm.MIN_ROWS)]
            variants += [("triton", impls["triton"], _parse_config(text)) for text in args.configs]
            if args.sweep:
                variants += [("triton", impls["triton"], config) for config in _sweep(rows)]
            for name, fn, config in variants:
                row = dict(m=rows, n=cols, k=depth, impl=name, config=str(config) if config else "default",
                           copies=len(inputs), floor_us=round(floor_us, 2))
                try:
                    with contextlib.ExitStack() as context:
                        if config:
                            context.enter_context(triton_mm.override_launch_config(config))
                        diff = (fn(**inputs[0]).float() - expected).abs().max().item() / scale
                        row["check"] = f"{diff:.1e} of max |out|" + ("" if diff < 1e-2 else " WRONG")
                        us = sized_replay_time(fn, inputs, max_calls=64)
                    row.update(us=round(us, 2), weight_copy_pct=round(100 * weight_bytes / (us * 1e-6)
                                                                      / (ceilings["memory_gbps"] * 1e9), 1),
                               fp8_rate_pct=round(100 * flops / (us * 1e-6) / (ceilings["fp8_tflops"] * 1e12), 1))
                except Exception as error:  # noqa: BLE001 - a failing variant is a finding, not the end
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "scaled_mm_goals.json"), "w") as f:  # kept if cut off
                    json.dump(dict(ceilings=ceilings, rows=rows_out), f, indent=1)
            del inputs, expected
            torch.cuda.empty_cache()
    print("\nper shape: best triton, best peer")
    for key in dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows_out):
        timed = [r for r in rows_out if (r["m"], r["n"], r["k"]) == key and "us" in r and "WRONG" not in r["check"]]
        ours = min((r for r in timed if r["impl"] == "triton"), key=lambda r: r["us"], default=None)
        peer = min((r for r in timed if r["impl"] != "triton"), key=lambda r: r["us"], default=None)
        if ours is None:
            continue
        text = f"M {key[0]} N {key[1]} K {key[2]}: triton {ours['us']} us ({ours['weight_copy_pct']}% copy, " \
               f"{ours['fp8_rate_pct']}% fp8) {ours['config']}"
        if peer:
            text += f"; {peer['impl']} {peer['us']} us: {peer['us'] / ours['us']:.2f}x"
        print(text)


if __name__ == "__main__":
    main()
