"""Route a batch of tokens with kernelmux.ops.grouped_topk and print what ran and why."""

import torch

import kernelmux
from kernelmux.engine.report import render_report

device = "cuda" if torch.cuda.is_available() else "cpu"

# DeepSeek-V3 routing: 256 experts in 8 groups, keep the 4 best groups, pick 8 experts per token.
logits = torch.randn(16, 256, device=device)
bias = torch.randn(256, device=device) * 0.1
weights, ids = kernelmux.ops.grouped_topk(
    logits, topk=8, renormalize=True, num_expert_group=8, topk_group=4,
    scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bias,
)
print("token 0 experts:", sorted(ids[0].tolist()))
print("token 0 weights sum:", round(weights[0].sum().item(), 4), "(= routed_scaling_factor)")

# Integrators who call the same shapes every step can skip dispatch entirely:
route = kernelmux.resolve("grouped_topk", logits, 8, True, 8, 4, "sigmoid", 2.5, bias)
print("resolved implementation:", f"{route.__module__}.{route.__qualname__}")

# The startup selection and every call's decision, as a table (kernelmux.report() gives JSON).
from rich.console import Console  # noqa: E402

Console(width=120).print(render_report(kernelmux.report()))
