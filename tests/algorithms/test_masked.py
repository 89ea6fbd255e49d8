"""Masked reductions against hand-computed values."""

import pytest
import torch

from hybridflow.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_masked_sum_and_mean_ignore_padding():
    # kept: 1, 2, 3 -> sum 6, mean 6 / (3 + 1e-8) = 2
    assert masked_sum(VALUES, MASK).item() == pytest.approx(6.0)
    assert masked_mean(VALUES, MASK).item() == pytest.approx(2.0)
    # per row (axis=-1): the single row gives 2
    assert masked_mean(VALUES, MASK, axis=-1).tolist() == pytest.approx([2.0])


def test_masked_sum_does_not_leak_nan_from_padding():
    values = torch.tensor([[1.0, float("nan")]])
    assert masked_sum(values, torch.tensor([[1.0, 0.0]])).item() == 1.0


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_unbiased_and_biased():
    # deviations from 2: -1, 0, 1 -> mean of squares 2/3; Bessel 3/2 -> 1
    assert masked_var(VALUES, MASK).item() == pytest.approx(1.0)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_var_rejects_single_element():
    with pytest.raises(ValueError, match="one position"):
        masked_var(VALUES, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="no position"):
        masked_var(VALUES, torch.zeros_like(MASK))


def test_masked_whiten():
    # (x - 2) / sqrt(1 + 1e-8); the padded 100 is transformed too (98), as in verl
    out = masked_whiten(VALUES, MASK)
    assert out.tolist()[0] == pytest.approx([-1.0, 0.0, 1.0, 98.0], abs=1e-6)
    # shift_mean=False adds the mean back
    assert masked_whiten(VALUES, MASK, shift_mean=False).tolist()[0][:3] == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)
