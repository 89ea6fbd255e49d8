"""Router losses and metrics against hand-computed values and transformers' own load-balancing loss."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hybridflow.algorithms.router_losses import (
    compute_dropped_token_fraction,
    compute_load_balancing_loss,
    compute_router_entropy,
    compute_router_metrics,
    compute_router_z_loss,
    compute_tokens_per_expert,
)

# One layer, 3 tokens, 2 experts, top-1; token 2 is padding.
LOGITS = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 5.0]]])
SELECTED = torch.tensor([[[0], [0], [1]]])
MASK = torch.tensor([1, 1, 0])


def test_load_balancing_loss_hand_computed():
    # probs: [.5, .5], [.75, .25]; f = [2/2, 0]; P = [.625, .375]; E * sum(f * P) = 2 * .625
    loss = compute_load_balancing_loss(LOGITS, SELECTED, 2, MASK)
    assert loss.item() == pytest.approx(1.25, abs=1e-6)


def test_load_balancing_loss_equals_transformers():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 4, generator=gen)
    selected = torch.softmax(logits, -1).topk(2, dim=-1).indices
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ours = compute_load_balancing_loss(logits, selected, 4, mask.reshape(-1))
    theirs = load_balancing_loss_func(tuple(logits), 4, 2, mask)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)


def test_load_balancing_loss_has_gradient_to_logits():
    logits = LOGITS.clone().requires_grad_(True)
    compute_load_balancing_loss(logits, SELECTED, 2, MASK).backward()
    assert logits.grad[0, :2].abs().sum() > 0 and logits.grad[0, 2].abs().sum() == 0


def test_router_z_loss_hand_computed():
    # logsumexp: log 2, log 4 (padding ignored) -> mean of squares
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert compute_router_z_loss(LOGITS, MASK).item() == pytest.approx(expected, abs=1e-6)


def test_tokens_per_expert_entropy_and_dropped():
    counts = compute_tokens_per_expert(SELECTED, 2, MASK)
    assert counts.tolist() == [[2.0, 0.0]]
    entropy = compute_router_entropy(LOGITS, MASK)
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropy.tolist() == pytest.approx([(math.log(2.0) + h2) / 2], abs=1e-6)
    # capacity ceil(1.0 * 2 / 2) = 1: one of expert 0's two assignments is dropped
    assert compute_dropped_token_fraction(counts, 1.0).tolist() == [0.5]
    assert compute_dropped_token_fraction(counts, 2.0).tolist() == [0.0]


def test_router_metrics_keys_and_values():
    metrics = compute_router_metrics(LOGITS, SELECTED, 2, MASK, capacity_factor=1.0)
    assert metrics["moe/layer_0/tokens_per_expert_max"].item() == 2.0
    assert metrics["moe/layer_0/tokens_per_expert_mean"].item() == 1.0
    assert metrics["moe/tokens_per_expert_max_over_mean"].item() == 2.0
    assert metrics["moe/dropped_token_fraction"].item() == 0.5
    assert "moe/dropped_token_fraction" not in compute_router_metrics(LOGITS, SELECTED, 2, MASK)
    with pytest.raises(ValueError, match="capacity_factor"):
        compute_router_metrics(LOGITS, SELECTED, 2, MASK, capacity_factor=0.0)
