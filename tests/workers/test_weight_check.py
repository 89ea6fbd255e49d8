"""Weight delivery verified: a rollout that silently keeps stale weights is caught at the next hand-over, naming
the tensor, the rank and the policy version (`workers.weight_check`)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.models.tiny import build_tiny_model
from hybridflow.workers.weight_check import WeightDeliveryCheck, WeightDeliveryError, compute_tensor_fingerprint, pick_sample


def test_sample_and_fingerprint_hand_computed():
    assert pick_sample(list("abcdefghij"), 4) == ["a", "d", "g", "j"]
    assert pick_sample(["x", "y"], 4) == ["x", "y"]
    assert compute_tensor_fingerprint(torch.tensor([1.0, 2.5, -0.5]), torch.float32) == 3.0
    # cast to the serving dtype first: 1 + 2**-10 is 1 in bfloat16
    assert compute_tensor_fingerprint(torch.tensor([1.0 + 2**-10]), torch.bfloat16) == 1.0


@torch.no_grad()
def train_a_step(model: torch.nn.Module, step: int) -> None:
    for index, parameter in enumerate(model.parameters()):
        parameter.add_(1e-3 * (step + index + 1))


def test_a_rollout_that_keeps_stale_weights_is_caught_at_the_next_hand_over(monkeypatch):
    actor, tokenizer = build_tiny_model(seed=0)
    rollout = HFRollout(copy.deepcopy(actor), tokenizer, SamplingParams(max_new_tokens=4))
    check = WeightDeliveryCheck(rollout, rank=1)
    assert len(check.expected_shapes) == 8

    train_a_step(actor, 1)
    rollout.update_weights(check.record(actor.named_parameters()))
    metrics = check.verify(version=1)
    assert metrics == {"rollout/weights_checked": 8.0, "rollout/weights_version": 1.0}

    def update_that_skips(named_tensors):  # the silent failure: the tensors arrive, nothing is loaded
        for _ in named_tensors:
            pass

    monkeypatch.setattr(rollout, "update_weights", update_that_skips)
    train_a_step(actor, 2)
    rollout.update_weights(check.record(actor.named_parameters()))
    with pytest.raises(WeightDeliveryError, match=r"rank 1: .*policy version 2.*tensor 'model\.embed_tokens\.weight'"):
        check.verify(version=2)


def test_a_hand_over_under_other_names_is_caught(monkeypatch):
    actor, tokenizer = build_tiny_model(seed=0)
    rollout = HFRollout(copy.deepcopy(actor), tokenizer, SamplingParams(max_new_tokens=4))
    check = WeightDeliveryCheck(rollout, rank=0)
    # a backend that ignores names it does not know, handed names without the rollout's mapping (e.g. peft's)
    monkeypatch.setattr(rollout, "update_weights", lambda named_tensors: [None for _ in named_tensors])
    renamed = ((f"base_model.{name}", tensor) for name, tensor in actor.named_parameters())
    rollout.update_weights(check.record(renamed))
    with pytest.raises(WeightDeliveryError, match="carried none of the rollout's sampled tensors"):
        check.verify(version=1)
