"""Fake vllm-xpu-kernels 0.1.16.2: the _C extension, registering reshape_and_cache_flash, silu/gelu_and_mul and
the FP8 / MXFP4 quantizers with the shipped schemas, their host checks (cache.cpp, fp8_quant.cpp,
mxfp4_quant.h) and CPU kernels that model the SYCL arithmetic (reciprocal multiplies, scale floors, ties)."""

import torch

from vllm_xpu_kernels._library import define

CALLS = []  # (op name, dict of what reached the kernel), one per call

FP8_TYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK


def _raw(tensor, what):
    assert tensor.is_contiguous(), f"fake vllm_xpu_kernels: {what} is read through its raw pointer (no strides)"


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    if kv_cache_dtype != "auto" and kv_cache_dtype not in FP8_TYPES:
        raise RuntimeError(f"Unsupported data type of kv cache: {kv_cache_dtype}")
    _check(key.dtype in KV_INPUTS, f"Unsupported input type of kv cache: {key.dtype}")
    num_tokens, num_heads, head_size = slot_mapping.shape[0], key.shape[1], key.shape[2]
    assert slot_mapping.dtype == torch.int64, "fake vllm_xpu_kernels: slot_mapping is read as int64_t"
    _raw(slot_mapping, "slot_mapping")
    if key_cache.stride(2) != head_size:
        # is_strided_head: the interleaved "new layout", which wants value_cache right after key_cache.
        _check(value_cache.data_ptr() == key_cache.data_ptr() + head_size * key_cache.element_size(),
               "new layout requires value_cache to be adjacent to key_cache")
        raise NotImplementedError("fake vllm_xpu_kernels: the interleaved cache layout is not modelled")
    _check(key_cache.stride(0) == value_cache.stride(0), "key_cache.stride(0) == value_cache.stride(0)")
    # Each token's num_heads * head_size elements are one run in the input (from key + t * key.stride(0))
    # and in the cache (from block * stride(0) + offset * stride(1)); V is addressed with K's strides.
    for tensor, what in ((key, "key"), (value, "value")):
        assert tensor.stride(2) == 1 and (num_heads == 1 or tensor.stride(1) == head_size), (
            f"fake vllm_xpu_kernels: {what}'s heads must be one run per token")
    assert key_cache.stride(3) == 1, "fake vllm_xpu_kernels: the cache's head dim must be contiguous"
    if kv_cache_dtype == "auto":
        assert key_cache.element_size() == key.element_size(), (
            "fake vllm_xpu_kernels: kv_cache_dtype 'auto' copies the input's bytes into the cache")
    else:
        assert key_cache.element_size() == 1, "fake vllm_xpu_kernels: an fp8 cache holds one byte per element"
        assert k_scale.dtype == v_scale.dtype == torch.float32, "fake vllm_xpu_kernels: *k_scale is read as float"
    block_size = key_cache.shape[1]
    run = num_heads * head_size
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        # The cache's storage as the kernel addresses it: K's block and page strides, a run per slot.
        flat = cache.as_strided((cache.shape[0], block_size, run), (key_cache.stride(0), key_cache.stride(1), 1))
        rows = new.as_strided((num_tokens, run), (new.stride(0), 1))
        if kv_cache_dtype != "auto":
            fp8 = FP8_TYPES[kv_cache_dtype]
            limit = torch.finfo(fp8).max
            rows = (rows.float() / scale.reshape(()).float()).clamp(-limit, limit).to(fp8)
        rows = rows.view(cache.dtype)  # the kernel stores raw bytes of its cache type
        for token, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue  # padding
            flat[slot // block_size, slot % block_size] = rows[token]
    CALLS.append(("reshape_and_cache_flash", dict(tokens=num_tokens, heads=num_heads, kv_cache_dtype=kv_cache_dtype)))


def _act_and_mul(out, input, act):
    d = input.shape[-1] // 2
    _check(tuple(out.shape) == (*input.shape[:-1], d), "out must be [..., d]")
    _raw(out, "out")
    _raw(input, "input")
    gate, up = input[..., :d], input[..., d:]
    # ACT_FN returns the input dtype, then ACT_FN(x) * y is a product in that dtype.
    out.copy_((act(gate.float()).to(input.dtype).float() * up.float()).to(out.dtype))


def silu_and_mul(result, input):
    _act_and_mul(result, input, torch.nn.functional.silu)
    CALLS.append(("silu_and_mul", dict(rows=input.shape[0])))


def gelu_and_mul(out, input):
    _act_and_mul(out, input, torch.nn.functional.gelu)  # erf GELU (activation.cpp gelu_kernel)
    CALLS.append(("gelu_and_mul", dict(rows=input.shape[0])))


def _fp8_codes(x, scale, fp8):
    """ConvertWithScaleOp<true>: x * (1 / scale), clamped, cast."""
    limit = torch.finfo(fp8).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(fp8)


def _min_scaling(fp8):
    return 1.0 / (torch.finfo(fp8).max * 512.0)


def dynamic_scaled_fp8_quant(result, input, scale):
    _check(scale.dtype == torch.float32, "scale must be a float tensor")
    _check(scale.numel() == 1, "scale must be a single-element tensor")
    _check(input.stride(-1) == 1, "last dimension of input must be contiguous")
    _check(result.stride(-1) == 1, "last dimension of output must be contiguous")
    amax = input.float().abs().amax() if input.numel() else torch.zeros(())
    scale.fill_(float(amax / torch.finfo(result.dtype).max))  # no floor: 0 for an all-zero input
    result.copy_(_fp8_codes(input, scale.reshape(()), result.dtype))
    CALLS.append(("dynamic_scaled_fp8_quant", {}))


def dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub):
    amax = input.float().abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.reshape(()))
    row_scale = (amax / torch.finfo(result.dtype).max).clamp_min(_min_scaling(result.dtype))
    scale.copy_(row_scale.view(scale.shape))
    result.copy_(_fp8_codes(input, row_scale, result.dtype))
    CALLS.append(("dynamic_per_token_scaled_fp8_quant", {}))


def per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                              dummy_is_scale_transposed, dummy_is_tma_aligned):
    _raw(input, "input")
    rows, cols = input.shape
    assert cols % group_size == 0, "fake vllm_xpu_kernels: groups are read at group_id * group_size"
    groups = input.float().view(rows, cols // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp_min(eps)
    group_scale = (amax / fp8_max).clamp_min(_min_scaling(output_q.dtype))
    if scale_ue8m0:
        group_scale = torch.exp2(torch.ceil(torch.log2(group_scale.abs().clamp_min(1e-10))))
    output_s.copy_(group_scale)
    codes = (groups * (1.0 / group_scale).unsqueeze(-1)).clamp(fp8_min, fp8_max).to(output_q.dtype)
    output_q.copy_(codes.view(rows, cols))
    CALLS.append(("per_token_group_fp8_quant", dict(group_size=group_size, eps=eps)))


_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def per_token_group_quant_mxfp4(input, output_q, output_s, group_size, eps):
    _raw(input, "input")
    rows, cols = input.shape
    groups = input.float().view(rows, cols // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp_min(eps)
    group_scale = torch.exp2(torch.ceil(torch.log2((amax / 6.0).abs().clamp_min(eps))))
    output_s.copy_(group_scale)
    scaled = (groups * (1.0 / group_scale).unsqueeze(-1)).clamp(-6.0, 6.0)
    # float_to_fp4_e2m1: counts (|x| > midpoint), ties toward zero; the sign is x < 0.
    magnitude = scaled.abs()
    code = sum((magnitude > m).to(torch.uint8) for m in _E2M1_MIDPOINTS)
    code = code | ((scaled < 0).to(torch.uint8) << 3)
    code = code.view(rows, cols)
    output_q.copy_(code[:, 0::2] | (code[:, 1::2] << 4))
    CALLS.append(("per_token_group_quant_mxfp4", dict(group_size=group_size, eps=eps)))


define("_C", "reshape_and_cache_flash(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, Tensor "
             "slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()", reshape_and_cache_flash)
define("_C", "silu_and_mul(Tensor! result, Tensor input) -> ()", silu_and_mul)
define("_C", "gelu_and_mul(Tensor! out, Tensor input) -> ()", gelu_and_mul)
define("_C", "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()", dynamic_scaled_fp8_quant)
define("_C", "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()",
       dynamic_per_token_scaled_fp8_quant)
define("_C", "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
             "float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool "
             "dummy_is_tma_aligned ) -> ()", per_token_group_fp8_quant)
define("_C", "per_token_group_quant_mxfp4(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps)"
             " -> ()", per_token_group_quant_mxfp4)
