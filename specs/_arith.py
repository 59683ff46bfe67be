"""Arithmetic the references need to round the same on every device: torch's CUDA division of a tensor by
a Python number multiplies by the number's reciprocal (two roundings; its CPU division rounds once), so a
reference that promises an IEEE division divides by a tensor instead."""

import torch

__all__ = ["ieee_div"]


def ieee_div(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """``numerator / denominator`` correctly rounded on CPU and GPU alike (elementwise, in the numerator's
    dtype): the number becomes a tensor of the numerator's shape, device and dtype first."""
    return numerator / torch.full_like(numerator, denominator)
