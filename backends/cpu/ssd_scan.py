"""The cpu backend's ssd_scan: the reference's chunked SSD (the same chunks, so the same algorithm) with
fewer passes over its per-head Q x Q matrices. Each token's decay exponent is summed once per chunk in
fp64, so a segment's decay exp(cs_i - cs_j) comes from a difference that keeps its digits (the
reference sums every segment directly to the same end) and is written once in fp32, exponentiated and
masked in place; dt' scales x (Q x P) instead of the Q x Q matrix; C.B is formed per group and
multiplied into the decays without being copied to every head; chunks are batched up to
MAX_DECAY_ELEMENTS, the states passed between them one chunk at a time, and a short last chunk is
computed at its own length (the reference pads it to a whole chunk)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernelmux.specs import ssd_scan as spec

__all__ = ["ssd_scan"]

# Chunks are computed together up to this many elements of their Q x Q decay matrices (32 MiB of fp32;
# Mamba2's 80 heads x 256 x 256 is one chunk at a time): small chunks share each op's fixed cost, as the
# reference's, and long prompts do not hold every chunk's matrices at once.
MAX_DECAY_ELEMENTS = 1 << 23


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = spec.NO_UPPER_DT_LIMIT,
    initial_states: Optional[torch.Tensor] = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's ssd_scan; arguments are validated by the caller."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1], B.shape[2]
    heads_per_group = num_heads // num_groups
    bounds = cu_seqlens.tolist()
    num_seqs = len(bounds) - 1
    delta = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        delta = F.softplus(delta)
    delta = delta.clamp_min(dt_min)
    if dt_max < spec.NO_UPPER_DT_LIMIT:
        delta = delta.clamp_max(dt_max)
    # Head-major fp32 operands, [Hh, T, .] (one copy each), and the decay exponents of every token.
    x_heads = x.float().permute(1, 0, 2).contiguous()  # [Hh, T, P]
    dtx = x_heads * delta.t()[:, :, None]  # dt'_t x_t
    B_groups = B.float().permute(1, 0, 2).contiguous()  # [G, T, N]
    C_groups = C.float().permute(1, 0, 2).contiguous()
    exponents = (delta * A.float()).t().double()  # [Hh, T]: log of each token's decay, fp64 for the sums
    y_heads = torch.empty_like(x_heads)
    final = torch.empty((num_seqs, num_heads, head_dim, state_dim), dtype=torch.float32)
    for seq in range(num_seqs):
        start, end = bounds[seq], bounds[seq + 1]
        state = (initial_states[seq].float().clone() if initial_states is not None
                 else torch.zeros((num_heads, head_dim, state_dim), dtype=torch.float32))
        full_end = start + (end - start) // chunk_size * chunk_size
        step = chunk_size * max(1, MAX_DECAY_ELEMENTS // (num_heads * chunk_size * chunk_size))
        for first in range(start, full_end, step):
            state = _chunks(slice(first, min(first + step, full_end)), chunk_size, dtx, B_groups, C_groups, exponents,
                            state, y_heads, heads_per_group)
        if full_end < end:  # the short last chunk as one chunk of its own length: no padding tokens
            state = _chunks(slice(full_end, end), end - full_end, dtx, B_groups, C_groups, exponents, state, y_heads,
                            heads_per_group)
        final[seq] = state
    y = y_heads.permute(1, 0, 2)  # [T, Hh, P] view
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype).contiguous(), final  # (.to keeps an fp32 view as it is)


def _chunks(tokens: slice, chunk_size: int, dtx: torch.Tensor, B_groups: torch.Tensor, C_groups: torch.Tensor,
            exponents: torch.Tensor, state: torch.Tensor, y_heads: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """Consecutive whole chunks of one sequence (``tokens`` a multiple of ``chunk_size`` long): writes
    their tokens' y (without D and z) into y_heads and returns the state after the last token. Operands
    are head- (group-) major: dtx [Hh, T, P], B and C [G, T, N], exponents [Hh, T] fp64; state [Hh, P, N]
    fp32."""
    num_heads, _, head_dim = dtx.shape
    num_groups, _, state_dim = B_groups.shape
    q = chunk_size
    count = (tokens.stop - tokens.start) // q

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [X, T, ...] -> [X, chunks, Q, ...] of the tokens
        return t[:, tokens].unflatten(1, (count, q))

    sums = chunked(exponents).cumsum(dim=2)  # [Hh, c, Q] fp64: chunk start -> token i
    # L[h, c, i, j] = exp(sum_{j < k <= i} a_k) for i >= j, else 0: the fp64 difference written in fp32,
    # exponentiated and masked in place (above the diagonal it may overflow to inf; masked to 0).
    decays = torch.empty((num_heads, count, q, q), dtype=torch.float32)
    torch.sub(sums[..., :, None], sums[..., None, :], out=decays)
    decays.exp_().tril_()
    x_chunks = chunked(dtx)  # [Hh, c, Q, P]
    B_chunks, C_chunks = chunked(B_groups), chunked(C_groups)  # [G, c, Q, N]
    scores = torch.matmul(C_chunks, B_chunks.transpose(2, 3))  # [G, c, Q, Q]: C_i . B_j
    decays.view(num_groups, heads_per_group, count, q, q).mul_(scores[:, None])
    # Intra-chunk: y_i = sum_{j <= i} (C_i . B_j) L_ij dt'_j x_j.
    y = torch.matmul(decays, x_chunks)  # [Hh, c, Q, P]
    # Each chunk's own contribution to the state at its end (dt' x (x) B decayed from token to end), and
    # the states entering each chunk, passed along in order.
    to_end = (sums[..., -1:] - sums).exp().float()  # [Hh, c, Q]
    weighted = (x_chunks * to_end[..., None]).transpose(2, 3)  # [Hh, c, P, Q]
    own = torch.matmul(weighted.view(num_groups, heads_per_group, count, head_dim, q),
                       B_chunks[:, None]).view(num_heads, count, head_dim, state_dim)
    from_start = sums.exp().float()  # [Hh, c, Q]
    entering = torch.empty((num_heads, count, head_dim, state_dim), dtype=torch.float32)
    for c in range(count):
        entering[:, c] = state
        state = state.mul_(from_start[:, c, -1, None, None]).add_(own[:, c])
    # The state entering each chunk, decayed to token i and read out by C_i.
    inter = torch.matmul(C_chunks[:, None], entering.view(num_groups, heads_per_group, count, head_dim, state_dim)
                         .transpose(3, 4))  # [G, Hh/G, c, Q, P]
    y.add_(inter.view(num_heads, count, q, head_dim).mul_(from_start[..., None]))
    y_heads[:, tokens] = y.flatten(1, 2)
    return state
