"""Conformance comparison: closeness with max-relative and RMS error and the worst coordinates."""

from __future__ import annotations

import torch

from kernelmux.specs._spec import Tolerance

__all__ = ["assert_close", "assert_close_to_magnitude", "assert_same_kind", "error_stats"]


def assert_same_kind(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise AssertionError naming ``what`` unless shape, dtype and device match."""
    if (actual.shape != expected.shape or actual.dtype != expected.dtype
            or actual.device != expected.device):
        raise AssertionError(
            f"{what}: got {tuple(actual.shape)} {actual.dtype} on {actual.device}, expected "
            f"{tuple(expected.shape)} {expected.dtype} on {expected.device}"
        )


def error_stats(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Max absolute, max relative and RMS relative error of ``actual`` against ``expected`` (fp64)."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    if a.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "rms_rel": 0.0}
    diff = (a - e).abs()
    scale = e.abs().clamp_min(torch.finfo(torch.float32).tiny)
    rms_ref = e.pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    return {
        "max_abs": diff.max().item(),
        "max_rel": (diff / scale).max().item(),
        "rms_rel": (diff.pow(2).mean().sqrt() / rms_ref).item(),
    }


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, what: str
) -> None:
    """Raise AssertionError naming ``what``, the error statistics and the worst coordinates when
    any element is outside ``atol + rtol * |expected|`` or any NaN/Inf differs."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    nan_mismatch = a.isnan() != e.isnan()
    both_finite = a.isfinite() & e.isfinite()
    inf_mismatch = ~a.isnan() & ~e.isnan() & ~both_finite & (a != e)
    limit = tolerance.atol + tolerance.rtol * e.abs()
    excess = torch.where(both_finite, (a - e).abs() - limit, torch.zeros_like(a))
    bad = nan_mismatch | inf_mismatch | (excess > 0)
    if not bool(bad.any()):
        return
    stats = error_stats(torch.where(both_finite, a, 0), torch.where(both_finite, e, 0))
    worst = torch.where(bad, excess.nan_to_num(float("inf")), -torch.ones_like(excess))
    order = worst.flatten().argsort(descending=True)[:5]
    coords = [tuple(int(i) for i in torch.unravel_index(j, a.shape)) for j in order]
    rows = ", ".join(f"{c}: got {a[c].item():.7g}, expected {e[c].item():.7g}" for c in coords)
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {a.numel()} elements outside atol={tolerance.atol:g} "
        f"rtol={tolerance.rtol:g} (max_abs={stats['max_abs']:.3g}, max_rel={stats['max_rel']:.3g}, "
        f"rms_rel={stats['rms_rel']:.3g}); worst {rows}"
    )


def assert_close_to_magnitude(
    actual: torch.Tensor,
    expected: torch.Tensor,
    magnitude: torch.Tensor,
    tolerance: Tolerance,
    what: str,
    magnitude_meaning: str,
) -> None:
    """Closeness for reductions (GEMMs, expert sums): each element within
    ``atol * magnitude + rtol * |expected|``, where ``magnitude`` is the size of the terms summed
    into it (e.g. sum_k |a||b|), so one tolerance holds for any K. Non-finite values must match
    exactly (NaN with NaN). Raises AssertionError naming ``what``, the count and the worst five."""
    got, want = actual.detach().double().cpu(), expected.detach().double().cpu()
    mag = magnitude.double().cpu()
    both_finite = got.isfinite() & want.isfinite()
    special_mismatch = ~both_finite & ~((got == want) | (got.isnan() & want.isnan()))
    limit = tolerance.atol * mag + tolerance.rtol * want.abs()
    excess = torch.where(both_finite, (got - want).abs() - limit, torch.zeros_like(got))
    bad = special_mismatch | (excess > 0)
    if not bool(bad.any()):
        return
    ratio = torch.where(both_finite, (got - want).abs() / limit.clamp_min(1e-300), 0)
    worst = torch.where(bad, ratio.nan_to_num(float("inf")), -1.0)
    order = worst.flatten().argsort(descending=True)[:5]
    coords = [tuple(int(i) for i in torch.unravel_index(j, got.shape)) for j in order]
    rows = ", ".join(
        f"{c}: got {got[c].item():.7g}, expected {want[c].item():.7g}, mag {mag[c].item():.4g}"
        for c in coords
    )
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {got.numel()} elements outside "
        f"{tolerance.atol:g} * mag + {tolerance.rtol:g} * |expected| (mag = {magnitude_meaning}); "
        f"worst {rows}"
    )
