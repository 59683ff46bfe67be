"""Issue 28's goal shapes for fused_moe at full model size (every expert on this GPU), built on the
device: Mixtral-8x7B and Qwen3-30B-A3B in bf16 and DeepSeek-V3 with 128-block fp8 weights, at T = 1,
64 and 4096. Each implementation that serves a shape (the triton backend's kernels; torch's
grouped_mm and DeepGEMM as peers) is timed by CUDA-graph replay over four routings (so decode reads
cold experts, as a serving step does), after its output is checked: against the spec's reference
where that is cheap (check_close), else against the peer (the largest difference relative to the
peer's largest output). Times are set against the copy bandwidth and matmul rates measured in the
same run: "roofline" is the larger of the spec's FLOPs at the matmul rate and its bytes (the experts
actually routed to) at the copy rate. --sweep also times the triton backend under each launch
configuration of SWEEP, checked the same way first.

    python perf/diag/fused_moe_goals.py --out DIR [--models mixtral qwen3 deepseek] [--tokens 1 64 4096] [--sweep]
        [--impls triton torch deepgemm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

from kernelmux.backends.triton import fused_moe as triton_moe
from kernelmux.backends.triton.fused_moe import GemmConfig, LaunchConfig
from kernelmux.perf import ceilings as ceilings_module
from kernelmux.perf.timing import graph_replay_time
from kernelmux.specs import fused_moe as spec
from kernelmux.specs.scaled_mm import quantize_weight_blocks

MODELS = {  # E, top-k, H, I, quantization
    "mixtral": (8, 2, 4096, 14336, "none"),
    "qwen3": (128, 8, 2048, 768, "none"),
    "deepseek": (256, 8, 7168, 2048, "fp8_block"),
}
ROUTINGS = 4
# Checked with the spec's reference (its magnitude dequantizes every routed expert on the host) up
# to this many routed expert weights; bigger shapes are compared with the peer.
REFERENCE_MAX_WEIGHTS = 2e9


def _sweep(quantization: str, pairs_per_expert: float) -> list[LaunchConfig]:
    """Row blocks near the pairs an expert gets (decode: 16; T = 4096: 64 and 128), each with column
    tiles of 32-128, 4 or 8 warps and 3 or 4 stages; fp8_block keeps 128-wide k-steps."""
    if pairs_per_expert <= 16:
        block_ms = (16,)
    elif pairs_per_expert <= 64:
        block_ms = (16, 32, 64)
    else:
        block_ms = (64, 128)
    configs = []
    for block_m in block_ms:
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                if block_m * block_n < 1024 and warps == 8:
                    continue
                block_k = 128 if quantization != "none" or block_m * block_n <= 2048 else 64
                tiles = GemmConfig(block_n, block_k, group_m=1 if block_m == 16 else 8, num_warps=warps,
                                   num_stages=stages)
                configs.append(LaunchConfig(block_m, tiles, tiles))
    return configs


def _build(model: str, tokens: int, seed: int = 0) -> list[dict]:
    experts, topk, hidden_size, inter_size, quantization = MODELS[model]
    gen = torch.Generator("cuda").manual_seed(seed)

    def weights(rows: int, cols: int) -> torch.Tensor:
        bound = (3.0 / cols) ** 0.5
        return torch.empty(experts, rows, cols, dtype=torch.bfloat16, device="cuda").uniform_(-bound, bound,
                                                                                              generator=gen)

    w1, w2 = weights(2 * inter_size, hidden_size), weights(hidden_size, inter_size)
    w1_scale = w2_scale = None
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
    else:
        try:
            import deep_gemm  # noqa: F401

            from kernelmux.backends.deepgemm import fused_moe as deepgemm_moe

            impls["deepgemm"] = deepgemm_moe.fused_moe
        except Exception as error:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
            print(f"deepgemm peer unavailable: {type(error).__name__}: {error}")
    return impls


def _time(fn, inputs) -> float:
    fn(**inputs[0])
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(**inputs[0])
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) * 1e6
    calls = max(4, min(32, int(200_000 / max(eager_us, 1.0))))
    return graph_replay_time(fn, inputs, calls_per_graph=calls, trials=10).median_us


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
    parser.add_argument("--impls", nargs="*", default=None,
                        help="time only these (default: all); the peer still checks the triton rows")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceilings = ceilings_module.measure("cuda", quick=True, only=("memory_gbps", "bf16_tflops", "fp8_tflops"))
    print("ceilings:", {k: round(v, 1) for k, v in ceilings.items() if v is not None})
    rows = []
    for model in args.models:
        quantization = MODELS[model][4]
        rate = ceilings["fp8_tflops" if quantization != "none" else "bf16_tflops"]
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
            if args.sweep:
                pairs_per_expert = tokens * MODELS[model][1] / MODELS[model][0]
                variants += [("triton", triton_moe.fused_moe, config)
                             for config in _sweep(quantization, pairs_per_expert)]
            for name, fn, config in variants:
                row = dict(model=model, tokens=tokens, impl=name, config=str(config) if config else "default",
                           experts_used=experts_used, roofline_us=round(floor_us, 2))
                try:
                    context = triton_moe.override_launch_config(config) if config else contextlib.nullcontext()
                    with context:
                        row["check"] = _check(fn, inputs, expected, use_reference or name == peer)
                        us = _time(fn, inputs)
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


if __name__ == "__main__":
    main()
