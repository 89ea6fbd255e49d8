"""PF-PPO's policy filtration: the weights of each reweight method, a resampled batch that keeps its rows whole
(tensors and per-sample columns alike), and verl's keys (refused where verl would not apply them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms.pf_ppo import WEIGHT_FLOOR, pf_ppo_resample_indices, pf_ppo_weights
from hybridflow.protocol import DataProto
from hybridflow.trainer.advantage import apply_pf_ppo
from hybridflow.trainer.config import load_config

SCORES = torch.tensor([1.0, -2.0, 0.0, 3.0, 3.0])


def test_weights_of_each_method():
    torch.testing.assert_close(pf_ppo_weights(SCORES, "pow", 2.0), torch.tensor([1.0, 4.0, 0.0, 9.0, 9.0]) + WEIGHT_FLOOR)
    torch.testing.assert_close(pf_ppo_weights(SCORES, "max_min", 2.0), torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0]) + WEIGHT_FLOOR)
    torch.testing.assert_close(pf_ppo_weights(SCORES, "max_random", 2.0),
                               torch.tensor([0.1, 0.1, 0.1, 0.4, 0.4]) + WEIGHT_FLOOR)
    assert (pf_ppo_weights(torch.zeros(4), "pow", 2.0) > 0).all()  # flat scores: a uniform draw, not an error
    with pytest.raises(ValueError, match="unknown PF-PPO reweight_method 'top'"):
        pf_ppo_weights(SCORES, "top", 2.0)


def test_max_min_keeps_only_the_extremes_and_pow_favours_large_scores():
    generator = torch.Generator().manual_seed(0)
    drawn = pf_ppo_resample_indices(SCORES, "max_min", 2.0, generator)
    assert len(drawn) == len(SCORES) and set(drawn.tolist()) <= {1, 3, 4}
    many = pf_ppo_resample_indices(SCORES.repeat(200), "pow", 2.0, generator)
    counts = torch.bincount(many % 5, minlength=5).float()
    assert counts[2] == 0 and counts[3] > 3 * counts[0]  # zero score never drawn; 9 vs 1 weight


def test_a_resampled_batch_keeps_rows_whole():
    scores = torch.zeros(4, 3)
    scores[:, -1] = torch.tensor([0.0, 5.0, 0.0, -5.0])
    data = DataProto.from_dict(
        tensors={"token_level_scores": scores, "advantages": torch.arange(12.0).view(4, 3)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
        meta_info={"temperature": 1.0},
    )
    resampled, metrics = apply_pf_ppo(data, "max_min", 2.0, seed=3)
    assert len(resampled) == 4 and resampled.meta_info == {"temperature": 1.0}
    rows = {"a": 0, "b": 1, "c": 2, "d": 3}
    for uid, advantages in zip(resampled.non_tensor_batch["uid"], resampled.batch["advantages"], strict=True):
        assert uid in ("b", "d") and torch.equal(advantages, data.batch["advantages"][rows[uid]])
    assert metrics["pf_ppo/score_mean_before"] == 0.0 and metrics["pf_ppo/unique_fraction"] <= 0.5
    again, _ = apply_pf_ppo(data, "max_min", 2.0, seed=3)
    assert list(again.non_tensor_batch["uid"]) == list(resampled.non_tensor_batch["uid"])  # the seed decides


def test_verl_keys_and_the_estimator_it_applies_to():
    cfg = load_config(["algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=max_random",
                       "algorithm.pf_ppo.weight_pow=1.5"])
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo.reweight_method == "max_random"
    with pytest.raises(ValueError, match=r"use_pf_ppo=True with algorithm.adv_estimator='grpo'.*use algorithm.adv_estimator=gae"):
        load_config(["algorithm.use_pf_ppo=True", "algorithm.adv_estimator=grpo"])
    with pytest.raises(ValueError, match=r"reweight_method='top' is not one of"):
        load_config(["algorithm.pf_ppo.reweight_method=top"])
