"""Fake deep_gemm (sgl-deep-gemm 0.1.4.post1): fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous,
transform_sf_into_required_layout and get_mk_alignment_for_contiguous_layout with the shipped Python
signatures, the host checks of csrc/apis/gemm.hpp, apis/layout.hpp and utils/layout.hpp for the sm_90
1D2D path, the contiguous layout's rules (scheduler/gemm.cuh) and the block-scaled GEMM here in fp64."""
import weakref

import torch

__version__ = "0.1.4.post1"

ARCH_MAJOR = 9  # the device's compute-capability major, as device_runtime->get_arch_major() reads it
CALLS = []  # one record per fp8_gemm_nt / m_grouped call that reached the kernel
MK_ALIGNMENT = 128  # heuristics_runtime's kLegacyMKAlignmentForContiguousLayout (set_mk_alignment... moves it)
WGMMA_M = 64  # rows of one math warpgroup: the unit is_computation_valid skips
TMA_BYTES = 16


def _check(condition, what):
    # DG_HOST_ASSERT raises a RuntimeError naming the failed condition.
    if not condition:
        raise RuntimeError(f"Assertion error: {what}")


def _ceil_div(x, y):
    return (x + y - 1) // y


def _tma_aligned_size(mn, element_size):
    return _ceil_div(mn, TMA_BYTES // element_size) * (TMA_BYTES // element_size)


def _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups=None):
    _check(sf.dtype in (torch.float32, torch.int32), "sf_dtype == torch::kFloat or sf_dtype == torch::kInt")
    _check(sf.dim() == 2 + (num_groups is not None), "sf.dim() == static_cast<int>(num_groups.has_value()) + 2")
    if num_groups is not None:
        _check(sf.shape[-3] == num_groups, "sf.size(-3) == num_groups.value()")
    _check(sf.shape[-2] == _ceil_div(mn, gran_mn), "sf.size(-2) == ceil_div(mn, gran_mn)")
    per_int = 1 if sf.dtype == torch.float32 else 4
    _check(sf.shape[-1] == _ceil_div(k, gran_k * per_int), "sf.size(-1) == ceil_div(k, gran_k * ...)")


def _is_mn_major_tma_aligned(sf, mn):
    return (sf.stride(-2) == 1 or mn == 1) and sf.stride(-1) == _tma_aligned_size(mn, sf.element_size())


def _to_mn_major_tma_aligned(sf):
    # get_mn_major_tma_aligned_tensor: the same values in a column-major buffer of M rounded up to 4.
    mn, groups = sf.shape
    if _is_mn_major_tma_aligned(sf, mn):
        return sf
    out = torch.empty_strided((mn, groups), (1, _tma_aligned_size(mn, 4)), dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return out


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False):
    # The shipped wrapper hands its arguments to _C positionally; so does this one, to the model below.
    out = _transform(sf, mn, k, recipe, num_groups, is_sfa, disable_ue8m0_cast)
    return _borrowed(sf) if out is sf else out


def _borrowed(sf):
    """Observed on an H200 (kernelmux check and a diagnostic, 2026-11-28): an input returned untransformed
    comes back through tvm-ffi as a tensor that does not hold the input's memory; once the input is freed
    the GEMM reads whatever reuses its block. Modelled as an alias that remembers its input weakly, and a
    GEMM that raises, where the GPU computes garbage, when that input is gone."""
    alias = sf.new_empty(0).set_(sf.untyped_storage(), sf.storage_offset(), sf.shape, sf.stride())  # no _base
    alias._fake_deep_gemm_input = weakref.ref(sf)
    return alias


def _check_held(sf, what):
    source = getattr(sf, "_fake_deep_gemm_input", None)
    if source is not None and source() is None:
        raise RuntimeError(f"fake deep_gemm: {what} is transform_sf_into_required_layout's untransformed "
                           "result, and its input has been freed: the GPU reads reused memory here")


def _transform(sf, mn, k, recipe, num_groups, is_sfa, disable_ue8m0_cast):
    """csrc/apis/layout.hpp's transform_sf_into_required_layout, on sm_90."""
    if len(recipe) == 3:
        _check(is_sfa is not None, "is_sfa.has_value()")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    else:
        _check(is_sfa is None, "not is_sfa.has_value()")
        gran_mn, gran_k = recipe
    _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups)
    if ARCH_MAJOR != 9 and not disable_ue8m0_cast:
        raise NotImplementedError("fake deep_gemm: the sm_100 UE8M0 packing is not modelled")
    if sf.dtype == torch.float32 and (gran_mn, gran_k) == (1, 128):
        if num_groups is not None:
            raise NotImplementedError("fake deep_gemm: grouped 1 x 128 scale factors are not modelled")
        return _to_mn_major_tma_aligned(sf)
    if sf.dtype == torch.float32 and (gran_mn, gran_k) == (128, 128):
        # check_sf_layout's sm90_sfb_check: contiguous, or contiguous after a transpose.
        if num_groups is not None:
            _check(sf.stride(-3) == sf.shape[-2] * sf.shape[-1], "sf.stride(-3) == sf.size(-2) * sf.size(-1)")
        _check((sf.stride(-1) == 1 and sf.stride(-2) == sf.shape[-1])
               or (sf.stride(-1) == sf.shape[-2] and sf.stride(-2) == 1),
               "(sf.stride(-1) == 1 and sf.stride(-2) == sf.size(-1)) or (...)")
        return sf
    raise RuntimeError("Unknown SF transformation")


def _check_tma(t, what):
    # cuTensorMapEncodeTiled fails (a CUDA driver error) on a misaligned address or row stride.
    if t.data_ptr() % TMA_BYTES or (t.stride(0) * t.element_size()) % TMA_BYTES:
        raise RuntimeError(f"CUDA driver error: CUDA_ERROR_INVALID_VALUE (tensor map of {what})")


def _parse_tensor_or_tuple(input):
    if type(input) is tuple or type(input) is list:
        return input[0], input[1]
    raise AssertionError("fake deep_gemm: pass (tensor, scale factors)")


def _gemm_1d2d(a, sfa, b, sfb, m, n, k):
    """d = sum over K groups g of (a_g @ b_g.T) * sfa[:, g] * sfb[n // 128, g], in fp64."""
    acc = torch.zeros(m, n, dtype=torch.float64)
    rows_of_n = torch.arange(n) // 128
    for g in range(_ceil_div(k, 128)):
        lo, hi = g * 128, min(k, (g + 1) * 128)
        partial = a[:, lo:hi].double().cpu() @ b[:, lo:hi].double().cpu().T
        acc += partial * sfa[:, g].double().cpu()[:, None] * sfb[rows_of_n, g].double().cpu()[None, :]
    return acc


def fp8_fp4_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='',
                    disable_ue8m0_cast=False):
    (a_data, a_sf), (b_data, b_sf) = _parse_tensor_or_tuple(a), _parse_tensor_or_tuple(b)
    if ARCH_MAJOR != 9:
        raise NotImplementedError("fake deep_gemm: only the sm_90 path is modelled")
    _check_held(a_sf, "sfa")
    _check_held(b_sf, "sfb")
    for t, name in ((a_data, "a"), (b_data, "b")):
        _check(t.dim() == 2 and (t.stride(-1) == 1 or t.stride(-2) == 1), f"{name}: major_check")
        _check(t.stride(-1) == 1, f"major_{name} == cute::UMMA::Major::K")  # fp8_requires_k_major on sm_90
        _check(t.dtype == torch.float8_e4m3fn, f"{name}.scalar_type() == torch::kFloat8_e4m3fn")
    _check(d.dim() == 2 and d.stride(-1) == 1, "check_major_type_cd(d): t.stride(-1) == 1")
    m, k = a_data.shape
    n, k_ = b_data.shape
    _check(tuple(d.shape) == (m, n) and k == k_, "m == m_ and n == n_ and k == k_")
    _check(d.dtype in (torch.bfloat16, torch.float32), "d.scalar_type() == torch::kBFloat16 or torch::kFloat")
    if m == 0 or n == 0:
        return
    if c is not None:
        _check(d.dtype == torch.float32 and c.dtype == torch.float32, "d.scalar_type() == torch::kFloat")
    if recipe is None and recipe_a is None:
        _check(a_sf.dtype == torch.float32 and b_sf.dtype == torch.float32,
               "sfa_dtype == torch::kFloat and sfb_dtype == torch::kFloat")
        recipe = (1, 128, 128)
    _check((recipe_a is None) == (recipe_b is None), "recipe_a.has_value() == recipe_b.has_value()")
    _check((recipe_a is None) != (recipe is None), "recipe_a.has_value() != recipe.has_value()")
    if recipe is None or tuple(recipe) != (1, 128, 128):
        raise NotImplementedError(f"fake deep_gemm: recipe {recipe} is not modelled")
    was_ready = _is_mn_major_tma_aligned(a_sf, m)
    sfa = _transform(a_sf, m, k, recipe, None, True, disable_ue8m0_cast)
    sfb = _transform(b_sf, n, k, recipe, None, False, disable_ue8m0_cast)
    # sm90_fp8_gemm_1d2d
    _check(c is None and d.dtype == torch.bfloat16, "not c.has_value() and d.scalar_type() == torch::kBFloat16")
    _check_tma(a_data, "a")
    _check_tma(b_data, "b")
    _check_tma(d, "d")
    if n % 8:
        raise RuntimeError("CUDA error: device-side trap (shape_n % 8 == 0)")
    CALLS.append(dict(m=m, n=n, k=k, compiled_dims=compiled_dims, sfa_was_ready=was_ready))
    d.copy_(_gemm_1d2d(a_data, sfa, b_data, sfb, m, n, k).to(d.dtype))


fp8_gemm_nt = fp8_fp4_gemm_nt


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None):
    (a_data, a_sf), (b_data, b_sf) = _parse_tensor_or_tuple(a), _parse_tensor_or_tuple(b)
    _m_grouped_contiguous(a_data, a_sf, b_data, b_sf, d, grouped_layout, recipe, recipe_a, recipe_b, compiled_dims,
                          disable_ue8m0_cast, use_psum_layout, expected_m_for_psum_layout)


m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous


def _m_grouped_contiguous(a, a_sf, b, b_sf, d, grouped_layout, recipe, recipe_a, recipe_b, compiled_dims,
                          disable_ue8m0_cast, use_psum_layout, expected_m_for_psum_layout):
    """csrc/apis/gemm.hpp's m_grouped_fp8_fp4_gemm_nt_contiguous and sm90_m_grouped_fp8_gemm_contiguous_1d2d."""
    if ARCH_MAJOR != 9:
        raise NotImplementedError("fake deep_gemm: only the sm_90 path is modelled")
    _check_held(a_sf, "sfa")
    _check_held(b_sf, "sfb")
    _check(a.dim() == 2 and a.stride(-1) == 1, "major_a == cute::UMMA::Major::K")
    _check(b.dim() == 3 and b.stride(-1) == 1, "major_b == cute::UMMA::Major::K")  # fp8_requires_k_major
    _check(grouped_layout.is_contiguous(), "grouped_layout.is_contiguous()")
    for t, name in ((a, "a"), (b, "b")):
        _check(t.dtype == torch.float8_e4m3fn, f"{name}.scalar_type() == torch::kFloat8_e4m3fn")
    m, k = a.shape
    num_groups, n, k_ = b.shape
    _check(d.dim() == 2 and tuple(d.shape) == (m, n) and k == k_, "m == m_ and n == n_ and k == k_")
    _check(n > 0 and k > 0 and num_groups > 0, "n > 0 and k > 0 and num_groups > 0")
    _check(d.dtype == torch.bfloat16, "d.scalar_type() == torch::kBFloat16")
    _check(grouped_layout.dtype == torch.int32, "grouped_layout.scalar_type() == torch::kInt")
    if use_psum_layout:
        raise NotImplementedError("fake deep_gemm: the psum layout is not modelled")
    _check(grouped_layout.dim() == 1 and grouped_layout.shape[0] == m, "m == m__")
    _check(expected_m_for_psum_layout is None, "not expected_m_for_psum_layout.has_value()")
    _check(d.stride(-1) == 1, "check_major_type_cd(d): t.stride(-1) == 1")
    if m == 0:
        return
    if recipe is None and recipe_a is None:
        recipe = (1, 128, 128)
    _check((recipe_a is None) == (recipe_b is None), "recipe_a.has_value() == recipe_b.has_value()")
    _check((recipe_a is None) != (recipe is None), "recipe_a.has_value() != recipe.has_value()")
    if recipe is None or tuple(recipe) != (1, 128, 128):
        raise NotImplementedError(f"fake deep_gemm: recipe {recipe} is not modelled")
    sfa_ready = _is_mn_major_tma_aligned(a_sf, m)
    sfa = _transform(a_sf, m, k, recipe, None, True, disable_ue8m0_cast)
    sfb = _transform(b_sf, n, k, recipe, num_groups, False, disable_ue8m0_cast)
    _check_tma(a, "a")
    _check_tma(b[0], "b")
    _check_tma(d, "d")
    layout = grouped_layout.cpu().long()
    _check(bool((layout < num_groups).all()), "grouped_layout < num_groups (else an illegal memory access)")
    # scheduler/gemm.cuh (MGroupedContiguous): an M block of MK_ALIGNMENT rows computes every row with the
    # group of its first row; a 64-row math warpgroup whose first row is < 0 is skipped (its rows keep
    # whatever d held). Rows that are -1 themselves are padding: what the kernel leaves there is
    # unspecified, so the fake writes NaN to them.
    row = torch.arange(m)
    block_group = layout[row // MK_ALIGNMENT * MK_ALIGNMENT]
    computed = (layout[row // WGMMA_M * WGMMA_M] >= 0) & (block_group >= 0) & (layout >= 0)
    out = d.detach().cpu().clone()
    for g in range(num_groups):
        rows = (computed & (block_group == g)).nonzero().flatten()
        if rows.numel():
            out[rows] = _gemm_1d2d(a[rows], sfa[rows], b[g], sfb[g], rows.numel(), n, k).to(d.dtype)
    out[layout < 0] = float("nan")
    CALLS.append(dict(kind="m_grouped_contiguous", m=m, n=n, k=k, num_groups=num_groups,
                      compiled_dims=compiled_dims, sfa_was_ready=sfa_ready, computed_rows=int(computed.sum())))
    d.copy_(out.to(d.device))


def get_mk_alignment_for_contiguous_layout():
    # utils/layout.py's wrapper of the tvm-ffi getter (re-exported at the top level by `from .utils import *`).
    return int(MK_ALIGNMENT)


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


def ceil_div(x, y):
    return _ceil_div(x, y)


def align(x, y):
    return _ceil_div(x, y) * y


__all__ = ["fp8_gemm_nt", "fp8_fp4_gemm_nt", "transform_sf_into_required_layout", "ceil_div", "align",
           "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous",
           "get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout",
           "get_k_alignment_for_contiguous_layout"]
