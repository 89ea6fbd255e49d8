"""Bradley-Terry loss values and the pairing of verifier-scored samples."""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.preference import bradley_terry_loss, preference_pairs


def test_bradley_terry_loss_and_accuracy():
    loss, metrics = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]))
    expected = -(math.log(1 / (1 + math.exp(-2.0))) + math.log(1 / (1 + math.exp(1.0)))) / 2
    assert loss.item() == pytest_approx(expected)
    assert metrics == {"rm/accuracy": 0.5, "rm/margin": 0.5}


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-6)


def test_pairs_best_against_worst_within_a_prompt():
    groups = ["a", "a", "a", "a", "b", "b", "c", "c", "c"]
    scores = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5]
    assert preference_pairs(groups, scores) == [(1, 3), (2, 0), (7, 6)]
    assert preference_pairs(groups, scores, max_pairs_per_group=1) == [(1, 3), (7, 6)]
