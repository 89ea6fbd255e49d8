"""Clipped value loss by hand."""

import pytest
import torch

from hybridflow.algorithms import compute_value_loss


def test_clipped_value_loss_by_hand():
    # values 0.5, clip 0.2 -> vpred clipped to [0.3, 0.7]: 1.0 -> 0.7, 2.0 -> 0.7, 0.0 -> 0.3
    # (v - R)^2: 0, 4, 9; (v_clip - R)^2: 0.09, 0.49, 7.29; max: 0.09, 4, 9 -> mean 13.09 / 3; times 0.5
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 3.0]])
    values = torch.full((1, 3), 0.5)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 3), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * 13.09 / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)  # only token 0 uses the clipped term
    loss.backward()
    # token 0 is clipped (no gradient); tokens 1, 2: 0.5 * 2 (v - R) / 3
    assert vpreds.grad.tolist()[0] == pytest.approx([0.0, 2.0 / 3, -3.0 / 3])


def test_value_loss_masks_and_aggregates():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 3.0]])
    values = torch.full((1, 3), 0.5)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # kept losses 0.09, 4 -> token-mean 2.045 -> 1.0225; token-sum 4.09 -> 2.045
    assert compute_value_loss(vpreds, returns, values, mask, 0.2)[0].item() == pytest.approx(1.0225)
    assert compute_value_loss(vpreds, returns, values, mask, 0.2, "token-sum")[0].item() == pytest.approx(2.045)
    # global token count 4 over 2 ranks: 0.5 * 4.09 / 4 * 2
    loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, dp_size=2, batch_num_tokens=4)
    assert loss.item() == pytest.approx(1.0225)
