"""Masked reductions over token tensors: sum, mean, variance, whitening.

These are the building blocks of every estimator and loss in `algorithms/`. The formulas follow
verl's `verl.utils.torch_functional` (mean divides by `mask.sum() + 1e-8`, variance is
Bessel-corrected by default, whitening uses `rsqrt(var + 1e-8)`), so numbers agree with verl.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "clip_by_value"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero.

    Args:
        values: (bs, response_len) float (any shape works).
        mask: same shape as `values`; 1 keeps a position, 0 drops it.
        axis: reduce this dimension only; `None` reduces everything to a 0-dim tensor.

    Returns:
        0-dim tensor, or `values` reduced along `axis`.

    Masked-out positions are replaced by 0 before multiplying, so a NaN or inf in padding cannot leak
    into the sum (verl does the same).
    """
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum(dim=axis) if axis is not None else (valid * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1: `masked_sum / (mask.sum() + 1e-8)`.

    Args:
        values: (bs, response_len) float.
        mask: same shape; 0/1 (or bool).
        axis: reduce this dimension only (e.g. `-1` gives a per-sequence mean, shape (bs,)).

    Returns:
        0-dim tensor, or reduced along `axis`. An all-zero mask gives 0, not NaN.
    """
    total = masked_sum(values, mask, axis)
    count = mask.sum(dim=axis) if axis is not None else mask.sum()
    return total / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the mask, over all dimensions (0-dim result).

    Args:
        values: (bs, response_len) float.
        mask: same shape; 0/1.
        unbiased: apply Bessel's correction `n / (n - 1)` with `n = mask.sum()`.

    Raises:
        ValueError: `unbiased` and the mask selects fewer than 2 positions (the correction divides by 0).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("masked_var: the mask selects no position; at least one element must be 1")
        if mask_sum == 1:
            raise ValueError(
                "masked_var: the mask selects one position, so the unbiased variance divides by zero; "
                "use a larger (mini-)batch or unbiased=False"
            )
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise `values` with the masked mean and (unbiased) variance: `(x - mean) * rsqrt(var + 1e-8)`.

    Args:
        values: (bs, response_len) float.
        mask: same shape; statistics use only positions where it is 1.
        shift_mean: if False, add the mean back (rescale only).

    Returns:
        (bs, response_len). Positions outside the mask are transformed too (as in verl); multiply by the
        mask if they must be zero.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp with tensor bounds: `max(min(x, tensor_max), tensor_min)` (all same shape)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)
