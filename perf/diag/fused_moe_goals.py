"""Issue 28's goal shapes for fused_moe at full model size (every expert on this GPU), built on the
device: Mixtral-8x7B and Qwen3-30B-A3B in bf16 and DeepSeek-V3 with 128-block fp8 weights, at T = 1,
64 and 4096, and gpt-oss-120b with MXFP4 weights (random codes and scales: the values do not change
the time) at T = 1 and 64. Each implementation that serves a shape (the triton backend's kernels; torch's
grouped_mm, the cuda backend's Hopper GEMMs (16-bit and fp8_block; called directly, past its floor on pairs
per expert) and DeepGEMM as peers) is timed by CUDA-graph replay over four routings (so decode reads
cold experts, as a serving step does), after its output is checked: against the spec's reference
where that is cheap (check_close), else against the peer (the largest difference relative to the
peer's largest output). Times are set against the copy bandwidth and matmul rates measured in the
same run: "roofline" is the larger of the spec's FLOPs at the matmul rate and its bytes (the experts
actually routed to) at the copy rate. --sweep also times the triton backend under each launch
configuration of _sweep, checked the same way first; --kernels adds each kernel's device time (the
profiler), --route-probe the triton call with its routing in three launches, --cuda-plans the cuda
backend under other plans, --dense-bound torch.mm on dense operands of the same FLOPs (no routing: a bound
for the grouped GEMMs under the same replay).

    python perf/diag/fused_moe_goals.py --out DIR [--models mixtral qwen3 deepseek] [--tokens 1 64 4096] [--sweep]
        [--impls triton torch cuda deepgemm] [--configs BM/BN/BK/WARPS/STAGES[/REDUCE] gemv/BN/BK/WARPS/STAGES ...]
        [--cuda-plans STAGES[p] ...] [--dense-bound] [--kernels] [--route-probe]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from unittest import mock

import torch

from kernelmux.backends.cuda import fused_moe as cuda_moe
from kernelmux.backends.triton import fused_moe as triton_moe
from kernelmux.backends.triton.fused_moe import GemmConfig, LaunchConfig
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import sized_replay_time
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.scaled_mm import quantize_weight_blocks

MODELS = {  # E, top-k, H, I, quantization
    "mixtral": (8, 2, 4096, 14336, "none"),
    "qwen3": (128, 8, 2048, 768, "none"),
    "deepseek": (256, 8, 7168, 2048, "fp8_block"),
    "gptoss": (128, 4, 2880, 2880, "mxfp4"),
}
ROUTINGS = 4
# Checked with the spec's reference (its magnitude dequantizes every routed expert on the host) up
# to this many routed expert weights; bigger shapes are compared with the peer.
REFERENCE_MAX_WEIGHTS = 2e9


def _sweep(quantization: str, tokens: int, pairs_per_expert: float) -> list[LaunchConfig]:
    """Decode GEMVs (the quantizations they serve, at most GEMV_MAX_TOKENS): 4- to 32-row tiles, k-steps of
    128-2048 weights, 2-8 warps, 1-4 stages. Decode (at most one pair per expert): 16-row blocks, narrow
    to wide column tiles (the grid is what keeps 132 SMs reading at T = 1), deep k-steps. Up to 16 per
    expert: 16- to 64-row blocks (one block per expert reads its weights once). Larger: 64- and 128-row
    blocks, 64-256 wide tiles, 4 or 8 warps, 3 or 4 stages, both top-k sums. fp8_block keeps 128-wide
    k-steps and gate-up tiles (the launch configuration clamps them)."""
    configs = []

    def add(block_m, block_n, block_k, warps, stages, group_m, reduce="pairs"):
        tiles = GemmConfig(block_n, block_k, group_m=group_m, num_warps=warps, num_stages=stages)
        configs.append(LaunchConfig(block_m, tiles, tiles, reduce))

    if tokens <= triton_moe.GEMV_MAX_TOKENS and quantization in triton_moe.GEMV_QUANTIZATIONS:
        widths = (512, 1024, 2048) if quantization in ("mxfp4", "nvfp4") else (128, 256, 512)
        for block_n in (4, 8, 16, 32):
            for block_k in widths:
                width = block_k // 2 if quantization in ("mxfp4", "nvfp4") else block_k
                if block_n * width <= 8192:  # gate-up holds two fp32 [BN, width] products: 128 registers a lane
                    configs.append(_parse_config(f"gemv/{block_n}/{block_k}/4/3"))
        for warps, stages in ((2, 3), (8, 3), (4, 1), (4, 4)):
            configs.append(_parse_config(f"gemv/16/{widths[1]}/{warps}/{stages}"))
        return configs
    if pairs_per_expert <= 1:
        for block_n in (16, 32, 64):
            for block_k in (128, 256):
                add(16, block_n, block_k, 4, 4, 1)
        add(16, 32, 128, 4, 3, 1, "atomic")
    elif pairs_per_expert <= 16:
        for block_m in (16, 32, 64) if pairs_per_expert > 4 else (16, 32):
            for block_n in (32, 64, 128):
                add(block_m, block_n, 128, 4, 4, 1 if block_m == 16 else 4)
        add(16, 64, 128, 4, 4, 4)
        add(32, 64, 128, 8, 4, 4)
    else:
        # fp8_block: 8 warps and 3 stages only (its calls take ~10x longer to time).
        shapes = ((8, 3),) if quantization == "fp8_block" else ((4, 4), (8, 3), (8, 4))
        for block_m in (64, 128):
            for block_n in (64, 128, 256):
                for warps, stages in shapes:
                    if block_n == 256 and warps == 4:
                        continue
                    add(block_m, block_n, 64, warps, stages, 8)
        add(128, 128, 64, 8, 3, 8, "atomic")
        if quantization != "fp8_block":
            add(64, 128, 64, 8, 4, 8, "atomic")
    if quantization == "fp8_block":  # gate-up's tile is pinned to 128: keep one per down tile
        seen, kept = set(), []
        for config in configs:
            key = (config.block_m, config.down, config.reduce)
            if key not in seen:
                seen.add(key)
                kept.append(config)
        configs = kept
    return configs


def _parse_config(text: str) -> LaunchConfig:
    """BM/BN/BK/WARPS/STAGES[/REDUCE] -> the configuration with those tiles for both GEMMs; gemv/BN/BK/WARPS/STAGES
    -> the decode GEMVs with those tiles for both."""
    fields = text.split("/")
    if fields[0] == "gemv":
        block_n, block_k, warps, stages = (int(v) for v in fields[1:])
        tiles = GemmConfig(block_n, block_k, group_m=1, num_warps=warps, num_stages=stages)
        return LaunchConfig(16, tiles, tiles, gemv=True)
    block_m, block_n, block_k, warps, stages = (int(v) for v in fields[:5])
    tiles = GemmConfig(block_n, block_k, group_m=1 if block_m == 16 else 8, num_warps=warps, num_stages=stages)
    return LaunchConfig(block_m, tiles, tiles, *fields[5:])


def _build(model: str, tokens: int, seed: int = 0) -> list[dict]:
    experts, topk, hidden_size, inter_size, quantization = MODELS[model]
    gen = torch.Generator("cuda").manual_seed(seed)

    def weights(rows: int, cols: int) -> torch.Tensor:
        bound = (3.0 / cols) ** 0.5
        return torch.empty(experts, rows, cols, dtype=torch.bfloat16, device="cuda").uniform_(-bound, bound,
                                                                                              generator=gen)

    w1_scale = w2_scale = None
    if quantization == "mxfp4":  # any codes; scale codes 118..122 (2^-9..2^-5), a trained layer's range
        def codes(rows: int, cols: int) -> torch.Tensor:
            return torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=gen)

        def scales(rows: int, cols: int) -> torch.Tensor:
            return torch.randint(118, 123, (experts, rows, cols // 32), dtype=torch.uint8, device="cuda",
                                 generator=gen)

        w1, w1_scale = codes(2 * inter_size, hidden_size), scales(2 * inter_size, hidden_size)
        w2, w2_scale = codes(hidden_size, inter_size), scales(hidden_size, inter_size)
    else:
        w1, w2 = weights(2 * inter_size, hidden_size), weights(hidden_size, inter_size)
    if quantization == "fp8_block":
        pairs = [quantize_weight_blocks(m) for m in w1]
        w1, w1_scale = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
        pairs = [quantize_weight_blocks(m) for m in w2]
        w2, w2_scale = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
        del pairs
    sets = []
    for _ in range(ROUTINGS):
        x = torch.randn(tokens, hidden_size, device="cuda", generator=gen)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        values, ids = logits.topk(topk, dim=-1)
        sets.append(dict(hidden=x.to(torch.bfloat16), w1=w1, w2=w2, topk_weights=values.softmax(dim=-1),
                         topk_ids=ids.to(torch.int32), activation="silu", expert_map=None,
                         apply_router_weight_on_input=False, quantization=quantization,
                         w1_scale=w1_scale, w2_scale=w2_scale))
    return sets


def _peers(quantization: str) -> dict:
    impls = {"triton": triton_moe.fused_moe}
    if quantization == "none":
        from kernelmux.backends.torch import fused_moe as torch_moe

        impls["torch"] = torch_moe.fused_moe
        if torch.cuda.get_device_capability() == cuda_moe.CAPABILITY:
            impls["cuda"] = cuda_moe.fused_moe
    elif quantization in cuda_moe.FP4_QUANTIZATIONS:  # the cuda decode GEMVs (at any T here: T > 1 rereads)
        if torch.cuda.get_device_capability() == cuda_moe.CAPABILITY:
            impls["cuda"] = cuda_moe.fused_moe
    elif quantization == "fp8_block":
        try:
            import deep_gemm  # noqa: F401

            from kernelmux.backends.deepgemm import fused_moe as deepgemm_moe

            impls["deepgemm"] = deepgemm_moe.fused_moe
        except Exception as error:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
            print(f"deepgemm peer unavailable: {type(error).__name__}: {error}")
        if torch.cuda.get_device_capability() == cuda_moe.CAPABILITY:  # after DeepGEMM: the check's peer
            impls["cuda"] = cuda_moe.fused_moe
    return impls


KERNELS = ("gemv_gate_up", "gemv_down", "route", "count", "layout", "scatter", "quantize", "gate_up", "down", "sum")


def _kernel_name(key: str) -> str:
    """A profiler key's kernel: the triton kernels' names, the cuda backend's by template (gate-up: GATED true) and
    its decode GEMVs'."""
    if "moe_gemm_sm90" in key:  # mangled (ILb<BF16>ELb<GATED>E) or demangled (<bf16, gated, ...>)
        return "gate_up" if re.search(r"moe_gemm_sm90(ILb[01]ELb1E|<\w+, true)", key) else "down"
    for kernel in ("route", "sum"):
        if f"moe_{kernel}_sm90" in key:
            return kernel
    for kernel in ("gate_up", "down"):  # the cuda decode GEMVs
        if f"moe_decode_{kernel}" in key or f"moe_decode_fp4_{kernel}" in key:
            return f"gemv_{kernel}"
    return next((k for k in KERNELS if f"moe_{k}_kernel" in key), key[:40])


def _kernel_times(fn, inputs) -> dict:
    """Device time per kernel of one call (us, the mean over a call per routing), from the profiler:
    what each launch costs, and by difference with the replayed call, the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    for kwargs in inputs:
        fn(**kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for kwargs in inputs:
            fn(**kwargs)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        name = _kernel_name(event.key)
        times[name] = round(times.get(name, 0.0) + event.self_device_time_total / len(inputs), 2)
    return times


def _dense_bound(kwargs: dict):
    """A function of the call's arguments that ignores them and runs the two GEMMs of the routed pairs as dense
    torch.mm (cuBLAS) on operands of their sizes: [pairs, H] x [H, 2I], then [pairs, I] x [I, H] (weights stored
    K-major, as w1 and w2 are). The FLOPs are the call's; what it leaves out is the routing and gathering."""
    pairs, hidden_size = kwargs["topk_ids"].numel(), kwargs["hidden"].shape[1]
    inter_size = kwargs["w1"].shape[1] // 2
    dtype = kwargs["hidden"].dtype
    a = torch.randn(pairs, hidden_size, device="cuda", dtype=dtype)
    b1 = torch.randn(2 * inter_size, hidden_size, device="cuda", dtype=dtype) / hidden_size ** 0.5
    mid = torch.randn(pairs, inter_size, device="cuda", dtype=dtype)
    b2 = torch.randn(hidden_size, inter_size, device="cuda", dtype=dtype) / inter_size ** 0.5

    def dense(**_) -> torch.Tensor:
        torch.mm(a, b1.t())
        return torch.mm(mid, b2.t())

    return dense


def _check(fn, inputs, expected, use_reference: bool) -> str:
    out = fn(**inputs[0])
    if use_reference:
        spec.check_close(out, expected, inputs[0])
        return "reference: ok"
    scale = expected.float().abs().max().item()
    return f"vs peer: max |diff| {(out.float() - expected.float()).abs().max().item() / scale:.2e} of max |out|"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 64, 4096])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--configs", nargs="*", default=[], metavar="BM/BN/BK/WARPS/STAGES[/REDUCE]",
                        help="also time these launch configurations (both GEMMs' tiles; group_m 8, 1 at BM 16)")
    parser.add_argument("--kernels", action="store_true", help="also profile each variant's kernels")
    parser.add_argument("--route-probe", action="store_true",
                        help="also time triton with the routing in three launches (the one-program bound at 0)")
    parser.add_argument("--dense-bound", action="store_true",
                        help="also time torch.mm on dense operands of the routed GEMMs' sizes (16-bit experts): "
                             "cuBLAS's rate on the same FLOPs under the same replay, no routing")
    parser.add_argument("--cuda-plans", nargs="*", default=[], metavar="STAGES[p]",
                        help="also time the cuda backend under these plans: pipeline stages, p for persistent CTAs")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="time only these (default: all); the peer still checks the triton rows")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps", "bf16_tflops", "fp8_tflops"))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    rows = []
    for model in args.models:
        quantization = MODELS[model][4]
        rate = ceilings["fp8_tflops" if quantization.startswith("fp8") else "bf16_tflops"]  # W4A16: bf16
        for tokens in args.tokens:
            inputs = _build(model, tokens)
            cost = spec.cost(inputs[0])
            experts_used = int(inputs[0]["topk_ids"].unique().numel())
            expert_weights = inputs[0]["w1"][0].numel() + inputs[0]["w2"][0].numel()
            use_reference = tokens <= 64 and experts_used * expert_weights <= REFERENCE_MAX_WEIGHTS
            impls = _peers(quantization)
            peer = next((name for name in impls if name != "triton"), None)
            expected = (spec.fused_moe(**inputs[0]) if use_reference or peer is None
                        else impls[peer](**inputs[0]))
            floor_us = max(cost.flops / (rate * 1e12), cost.bytes / (ceilings["memory_gbps"] * 1e9)) * 1e6
            variants = [(name, fn, None) for name, fn in impls.items() if args.impls is None or name in args.impls]
            if args.route_probe:
                variants.append(("triton-3-launch-routing", triton_moe.fused_moe, None))
            variants += [("triton", triton_moe.fused_moe, _parse_config(text)) for text in args.configs]
            if "cuda" in impls:
                variants += [("cuda", cuda_moe.fused_moe, cuda_moe.MoePlan(int(text.rstrip("p")), text.endswith("p")))
                             for text in args.cuda_plans]
            if args.dense_bound and quantization == "none":
                variants.append(("dense_mm", _dense_bound(inputs[0]), None))
            if args.sweep:
                pairs_per_expert = tokens * MODELS[model][1] / MODELS[model][0]
                variants += [("triton", triton_moe.fused_moe, config)
                             for config in _sweep(quantization, tokens, pairs_per_expert)]
            for name, fn, config in variants:
                row = dict(model=model, tokens=tokens, impl=name, config=str(config) if config else "default",
                           experts_used=experts_used, roofline_us=round(floor_us, 2))
                try:
                    context = contextlib.ExitStack()
                    with context:
                        if isinstance(config, cuda_moe.MoePlan):
                            context.enter_context(cuda_moe.override_plan(stages=config.stages,
                                                                         persistent=config.persistent))
                        elif config:
                            context.enter_context(triton_moe.override_launch_config(config))
                        if name == "triton-3-launch-routing":
                            context.enter_context(mock.patch.object(triton_moe, "ROUTE_ONE_PROGRAM_MAX_PAIRS", 0))
                        row["check"] = ("not the op: dense GEMMs of its sizes" if name == "dense_mm"
                                        else _check(fn, inputs, expected, use_reference or name == peer))
                        us = sized_replay_time(fn, inputs)
                        if args.kernels:
                            row["kernels_us"] = _kernel_times(fn, inputs)
                    row.update(us=round(us, 2), roofline_pct=round(100 * floor_us / us, 1),
                               copy_pct=round(100 * cost.bytes / (us * 1e-6) / (ceilings["memory_gbps"] * 1e9), 1))
                except Exception as error:  # noqa: BLE001 - a failing variant is a finding, not the end
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "fused_moe_goals.json"), "w") as f:  # kept if the run is cut off
                    json.dump(dict(ceilings=ceilings, rows=rows), f, indent=1)
            del inputs, expected
            torch.cuda.empty_cache()
    best = {}
    for row in rows:
        if "us" in row and row["impl"] == "triton":
            k = (row["model"], row["tokens"])
            if k not in best or row["us"] < best[k]["us"]:
                best[k] = row
    print("\nbest triton per shape:")
    for (model, tokens), row in best.items():
        peers = [r for r in rows if r["model"] == model and r["tokens"] == tokens and r["impl"] != "triton" and "us" in r]
        peer_text = ", ".join(f"{r['impl']} {r['us']} us" for r in peers)
        print(f"{model} T {tokens}: {row['us']} us ({row['roofline_pct']}% of roofline, {row['copy_pct']}% copy) "
              f"{row['config']}; {peer_text}")
        profiled = [r for r in rows if r["model"] == model and r["tokens"] == tokens and "kernels_us" in r]
        for kernel in ("gate_up", "down", "gemv_gate_up", "gemv_down"):
            timed = [r for r in profiled if kernel in r["kernels_us"]]
            if timed:
                fastest = min(timed, key=lambda r: r["kernels_us"][kernel])
                print(f"  fastest {kernel}: {fastest['kernels_us'][kernel]} us under {fastest['config']}")


if __name__ == "__main__":
    main()
