"""The Triton device functions both Mamba2 ops share (ssd_scan and selective_state_update): the time step
dt' from the raw dt, as the specs define it, in fp32."""

import triton
import triton.language as tl

# torch's softplus returns x itself above this (F.softplus's default threshold), and so does the kernel's.
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) in fp32 (x itself above SOFTPLUS_THRESHOLD, as torch): log1p through log(w) * u / (w - 1),
    w = 1 + u, which keeps a tiny u's digits that log(1 + u) rounds away (there is no log1p in tl)."""
    u = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    w = 1.0 + u
    small = w == 1.0
    log1p = tl.where(small, u, tl.log(w) * (u / tl.where(small, 1.0, w - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def time_step(dt, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, dt_min, dt_max, CLAMP: tl.constexpr):
    """dt' = clamp(softplus(dt + bias) if SOFTPLUS else dt + bias, dt_min, dt_max), all fp32 (CLAMP: whether the
    limits do anything)."""
    step = dt.to(tl.float32)
    if HAS_BIAS:
        step = step + bias.to(tl.float32)
    if SOFTPLUS:
        step = softplus(step)
    if CLAMP:
        step = tl.minimum(tl.maximum(step, dt_min), dt_max)
    return step
