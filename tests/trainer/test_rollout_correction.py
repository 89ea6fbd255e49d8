"""The driver's rollout-correction call on a DataProto, and what reaches the actor's loss: the weights multiply
each token's loss, rejected tokens leave the loss and its token count."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridflow.algorithms.config import RolloutCorrectionConfig
from hybridflow.protocol import DataProto
from hybridflow.trainer.rollout_correction import apply_rollout_correction
from hybridflow.workers.config import ActorConfig
from hybridflow.workers.ppo_update import GlobalCounts, compute_global_counts, make_actor_loss_fn

ROLLOUT = torch.full((2, 3), -1.0)
# Ratios pi_old / pi_rollout: 3, 1, 1.5 | 0.25, 1.2 (then padding).
OLD = ROLLOUT + torch.log(torch.tensor([[3.0, 1.0, 1.5], [0.25, 1.2, 1.0]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.int64)


def batch() -> DataProto:
    return DataProto.from_dict({
        "old_log_probs": OLD.clone(), "rollout_log_probs": ROLLOUT.clone(), "response_mask": MASK.clone(),
        "advantages": torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
    })


def test_token_tis_writes_weights_and_leaves_the_mask():
    data = batch()
    metrics = apply_rollout_correction(data, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    torch.testing.assert_close(data.batch["rollout_is_weights"], torch.tensor([[2.0, 1.0, 1.5], [0.25, 1.2, 0.0]]))
    assert torch.equal(data.batch["response_mask"], MASK)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((3 + 1 + 1.5 + 0.25 + 1.2) / 5)
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(3 * 1.5 * 0.25 * 1.2) / 5)


def test_rejection_replaces_the_response_mask_without_weights():
    data = batch()
    config = RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.25")
    metrics = apply_rollout_correction(data, config)
    # Geometric-mean ratios (3 * 1.5)^(1/3) = 1.65 and (0.25 * 1.2)^(1/2) = 0.55 are outside [0.8, 1.25].
    assert data.batch["response_mask"].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert data.batch["response_mask"].dtype == MASK.dtype and "rollout_is_weights" not in data.batch.keys()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    wide = batch()
    apply_rollout_correction(wide, dataclasses.replace(config, rollout_rs_threshold="0.5_1.7"))
    # -log 1.65 = -.50 and -log .55 = .60 against [log .5, log 1.7] = [-.69, .53]
    assert wide.batch["response_mask"].tolist() == [[1, 1, 1], [0, 0, 0]]


def test_missing_rollout_log_probs_names_the_source():
    data = batch()
    data.batch.pop("rollout_log_probs")
    with pytest.raises(ValueError, match=r"needs \['rollout_log_probs'\].*rollout engine"):
        apply_rollout_correction(data, RolloutCorrectionConfig(rollout_is="token"))


def test_weights_and_rejections_reach_the_actor_loss():
    """The loss of a corrected batch equals the hand-weighted token mean over the kept tokens only."""
    data = batch()
    apply_rollout_correction(data, RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0",
    ))
    assert data.batch["response_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]  # ratios 3 and 0.25 rejected
    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)
    counts = compute_global_counts(data.batch["response_mask"])
    assert counts == GlobalCounts(num_tokens=3.0, num_seqs=2.0, dp_size=1)
    loss_fn = make_actor_loss_fn(actor, counts)
    log_probs = OLD.clone()  # ratio 1 to the old log-probs: each token's loss is -A * weight
    loss, _ = loss_fn({"log_probs": log_probs}, data)
    expected = (-1.0 * 1.0 - 1.0 * 1.5 + 1.0 * 1.2) / 3  # kept tokens (0,1), (0,2), (1,1) with weights 1, 1.5, 1.2
    assert float(loss) == pytest.approx(expected)
    moved = log_probs.clone()
    moved[0, 0] += 5.0  # a rejected token's log-prob does not change the loss
    assert float(loss_fn({"log_probs": moved}, data)[0]) == pytest.approx(expected)
