"""fp32 GEMM shapes that torch's CPU sgemm runs fast, shared by the cpu backend's ops that multiply
dequantized weights (fused_moe, fp4_mm)."""

from __future__ import annotations

import torch

__all__ = ["PADDED_ROWS", "padded_rows"]

# fp32 GEMMs [n, K] x [K, M] with 2 <= M <= 16 run as M = 4 or 16 (zero rows appended): torch's
# CPU sgemm takes 263 / 377 / 263 / 508 / 308 us at M = 2 / 3 / 4 / 8 / 16 for a 256 x 4096 chunk
# (M = 1 is a GEMV, 136 us), perf/decisions/fused_moe.md.
PADDED_ROWS = (4, 16)


def padded_rows(a: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` with zero rows appended up to the next of PADDED_ROWS (2 <= M <= 16)."""
    tokens = a.shape[0]
    padded = next((p for p in PADDED_ROWS if tokens <= p), tokens) if tokens > 1 else tokens
    return torch.cat([a, a.new_zeros((padded - tokens, a.shape[1]))]) if padded != tokens else a
