"""Fake flashinfer.mamba (0.6.14): selective_state_update with the shipped signature, the single-token
checks of selective_state_update.cu and the kernels' arithmetic (selective_state_update.cuh), written
here independently: per-head parameters read through stride-0 broadcasts, a slot equal to pad_slot_id
neither read nor written but its output still computed (D * x, gated, from a zero state)."""
import torch

CALLS = []
ALGORITHMS = ("auto", "simple", "vertical", "horizontal", "async_horizontal")
_VECTOR = 16  # bytes: PackedAligned<input_t> loads (check_ptr_alignment_input_vars)


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # FLASHINFER_CHECK raises a tvm_ffi error (a RuntimeError)


def _softplus(v):
    return torch.where(v <= 20.0, torch.log(1.0 + torch.exp(v)), v)  # thresholded_softplus


def selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, pad_slot_id=-1, state_scale=None, out=None,
                           disable_state_update=False, intermediate_states_buffer=None,
                           intermediate_state_indices=None, intermediate_state_scales=None, rand_seed=None,
                           philox_rounds=10, cache_steps=0, algorithm="auto", dst_state_batch_indices=None,
                           cu_seqlens=None, num_accepted_tokens=None):
    CALLS.append(dict(algorithm=algorithm, batch=x.shape[0], pad_slot_id=pad_slot_id,
                      state_dtype=state.dtype, weight_dtype=dt.dtype))
    _check(algorithm in ALGORITHMS, f"Unknown algorithm: {algorithm}")
    _check(x.dim() == 3 and cu_seqlens is None and cache_steps == 0, "single-token calls only in this fake")
    _check(state.dim() == 4, "state must be 4D")
    cache, heads, dim, dstate = state.shape
    batch, groups = x.shape[0], B.shape[1]
    _check(dstate in (32, 64, 128, 256), f"DSTATE {dstate}: no kernel instance (vector loads of DSTATE / 32)")
    # The module instantiates the multi-token simple kernel for 4, 2 and 1 CTAs per head where DIM / CTAs >= 16
    # (each needing DIM / CTAs % 16 == 0), and the sm_9x one the horizontal kernel ((DIM / 64) * 4 warps):
    # other dims fail to compile (the H200 built 64 and 192, not 16, 48, 80 or 96).
    _check(dim % 64 == 0, f"Ninja build failed: DIM {dim}: static assertion failed (the module's kernels)")
    _check(state.stride(3) == 1 and state.stride(2) == dstate and state.stride(1) == dim * dstate,
           "state dims 1-3 must be contiguous")
    _check(cache >= batch, "state.size(0) must be >= x.size(0)")
    _check(heads % groups == 0, "nheads must be divisible by ngroups")
    _check(tuple(x.shape[1:]) == (heads, dim) and x.stride(2) == 1 and x.stride(1) == dim, "x layout")
    _check(tuple(dt.shape) == (batch, heads, dim) and dt.stride(1) == 1 and dt.stride(2) == 0,
           f"dt must be [batch, nheads, dim] with strides (., 1, 0), got {tuple(dt.stride())}")
    _check(tuple(D.shape) == (heads, dim) and D.stride() == (1, 0), f"D strides {tuple(D.stride())}")
    _check(tuple(A.shape) == (heads, dim, dstate) and A.stride() == (1, 0, 0), f"A strides {tuple(A.stride())}")
    if dt_bias is not None:
        _check(tuple(dt_bias.shape) == (heads, dim) and dt_bias.stride() == (1, 0), "dt_bias layout")
        _check(dt_bias.dtype == dt.dtype, "dt_bias must have the same dtype as dt")
    for name, t in (("B", B), ("C", C)):
        _check(tuple(t.shape) == (batch, groups, dstate) and t.stride(2) == 1 and t.stride(1) == dstate,
               f"{name} layout")
        _check(t.dtype == x.dtype, f"{name} must have the same dtype as x")
    if z is not None:
        _check(tuple(z.shape) == (batch, heads, dim) and z.stride(2) == 1 and z.stride(1) == dim, "z layout")
        _check(z.dtype == x.dtype, "z must have the same dtype as x")
    _check(D.dtype == dt.dtype, "D must have the same dtype as dt")
    _check(A.dtype == torch.float32, "A: fp32 (matrixA_t) in kernelmux's use")
    if out is not None:
        _check(out.is_contiguous() and tuple(out.shape) == (batch, heads, dim), "out layout")
        _check(out.dtype == x.dtype, "out must have the same dtype as x")
    for name, t in (("x", x), ("z", z), ("B", B), ("C", C)):
        if t is not None:
            _check(t.data_ptr() % _VECTOR == 0 and (t.stride(0) * t.element_size()) % _VECTOR == 0,
                   f"{name} pointer and batch stride must be aligned to 16 bytes")
    if state_batch_indices is not None:
        _check(state_batch_indices.dim() in (1, 2) and state_batch_indices.size(0) >= batch,
               "state_batch_indices shape")
    output = torch.empty_like(x) if out is None else out

    group_of = torch.arange(heads) // (heads // groups)
    a = A[:, 0, 0].double()
    d = D[:, 0].double()
    for b in range(batch):
        slot = b if state_batch_indices is None else int(state_batch_indices[b])
        live = slot != pad_slot_id
        if live and not 0 <= slot < cache:
            raise IndexError(f"slot {slot} outside the cache of {cache} (an illegal memory access)")
        step = dt[b, :, 0].double() + (dt_bias[:, 0].double() if dt_bias is not None else 0.0)
        if dt_softplus:
            step = _softplus(step)
        previous = state[slot].double() if live else torch.zeros(heads, dim, dstate, dtype=torch.float64)
        xb = x[b].double()
        new = (previous * torch.exp(a * step)[:, None, None]
               + (step[:, None] * xb)[:, :, None] * B[b].double()[group_of][:, None, :])
        yb = torch.einsum("hpn,hn->hp", new, C[b].double()[group_of]) + d[:, None] * xb
        if z is not None:
            zb = z[b].double()
            yb = yb * zb * torch.sigmoid(zb)
        output[b] = yb.to(output.dtype)
        if live and not disable_state_update:
            state[slot] = new.to(state.dtype)
    return output
