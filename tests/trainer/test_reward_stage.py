"""The driver's reward stage with stand-in worker groups (no Ray): outcome scores from the reward manager, the
reward model or both, and PRIME's implicit PRM (labels, its update order, dense rewards, checkpoints)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.algorithms.estimator_registry import estimator_spec
from hybridflow.algorithms.prime import implicit_token_rewards, prime_normalize
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import RewardResult
from hybridflow.trainer.reward_stage import ImplicitPRMStage, RewardStage, build_reward_stage

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
RULE = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 1.0]])
Q = torch.tensor([[0.5, -1.0, 0.0], [1.0, 2.0, 0.5], [-0.5, 0.0, 0.0], [0.0, 1.0, -1.0]])


def batch() -> DataProto:
    return DataProto.from_dict({"response_mask": MASK}, non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


def rule_rewards(data: DataProto) -> RewardResult:
    return RewardResult(reward_tensor=RULE.clone(), extra_info={"acc": [1.0, 0.0, 2.0, -1.0]},
                        metrics={"reward/errors": 0.0})


class Calls:
    """A stand-in worker group that records the methods called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def compute_rm_score(self, data: DataProto) -> DataProto:
        self.calls.append("compute_rm_score")
        return DataProto.from_dict({"rm_scores": torch.full(MASK.shape, 2.0), "prime_q": Q.clone()},
                                   meta_info={"metrics": {"timing_s/prime_rm_score": [0.1]}})

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        self.calls.append("compute_ref_log_prob")
        return DataProto.from_dict({"prime_ref_log_probs": torch.zeros(MASK.shape)})

    def update_rm(self, data: DataProto) -> DataProto:
        self.calls.append("update_rm")
        assert "prime_ref_log_probs" in data.batch.keys(), "the reference log-probs are fetched once, before"
        return DataProto.from_dict(meta_info={"metrics": {"reward_model/prime_loss": [0.25]}})

    def save_checkpoint(self, path: str) -> None:
        self.calls.append(f"save {Path(path).name}")

    def load_checkpoint(self, path: str) -> None:
        self.calls.append(f"load {Path(path).name}")


def config(estimator: str, update: str = "before", coef: float = 0.0) -> SimpleNamespace:
    model = SimpleNamespace(update=update, beta_train=0.1)
    section = SimpleNamespace(model=model, prime_granularity="token", prime_norm="batch_norm", rule_reward_coef=coef)
    algorithm = SimpleNamespace(adv_estimator=estimator, reward_dpo_coef=5.0, reward_gt_coef=5.0)
    return SimpleNamespace(reward_model=section, algorithm=algorithm, estimator=estimator_spec(estimator))


def test_rule_rewards_alone():
    stage = build_reward_stage(config("grpo"), rule_rewards, None)
    data, metrics, timing = batch(), {}, {}
    stage.score_into(data, metrics, timing)
    assert torch.equal(data.batch["token_level_scores"], RULE) and "acc" not in data.batch.keys()
    assert set(timing) == {"reward"} and metrics == {"reward/errors": 0.0}
    assert stage.process_rewards(data, metrics, timing) is None


@pytest.mark.parametrize(("coef", "stages"), [(0.0, {"rm"}), (1.0, {"rm", "reward"})])
def test_a_reward_model_scores_with_or_without_the_rules(coef, stages):
    reward_model = Calls()
    stage = build_reward_stage(config("gae", coef=coef), rule_rewards, reward_model)
    assert type(stage) is RewardStage
    data, timing = batch(), {}
    stage.score_into(data, {}, timing)
    assert set(timing) == stages and reward_model.calls == ["compute_rm_score"]
    expected = torch.full(MASK.shape, 2.0) + (RULE if coef else 0.0)
    assert torch.allclose(data.batch["token_level_scores"], expected)


@pytest.mark.parametrize(("update", "order"), [
    ("before", ["compute_ref_log_prob", "update_rm", "compute_rm_score"]),
    ("after", ["compute_ref_log_prob", "compute_rm_score", "update_rm"]),
    ("none", ["compute_ref_log_prob", "compute_rm_score"]),
])
def test_prime_labels_outcomes_trains_its_prm_and_gives_dense_rewards(update, order, tmp_path):
    prm = Calls()
    stage = build_reward_stage(config("prime", update=update), rule_rewards, prm)
    assert isinstance(stage, ImplicitPRMStage)
    data, metrics, timing = batch(), {}, {}
    stage.score_into(data, metrics, timing)
    assert prm.calls == [], "PRIME's outcome rewards are the rules', not the PRM's"
    assert torch.equal(data.batch["token_level_scores"], RULE)
    assert data.batch["acc"].tolist() == [1.0, 0.0, 1.0, 0.0]  # clamped to [0, 1]
    extra = stage.process_rewards(data, metrics, timing)
    assert prm.calls == order and "prime_rm" in timing
    expected = prime_normalize(implicit_token_rewards(Q, MASK, 0.1, "token"), "batch_norm")
    assert torch.allclose(extra["rm_scores"], expected) and torch.equal(data.batch["rm_scores"], extra["rm_scores"])
    assert extra["reward_dpo_coef"] == 5.0 and extra["reward_gt_coef"] == 5.0
    assert metrics["reward_model/implicit_reward/mean"] == pytest.approx(float((Q * MASK).sum(-1).mean()) * 0.1)
    assert 0.0 <= metrics["reward_model/dpo_acc"] <= 1.0
    assert ("reward_model/prime_loss" in metrics) == (update != "none")
    stage.save_checkpoint(tmp_path)
    stage.load_checkpoint(tmp_path)
    assert prm.calls[-2:] == ["save reward", "load reward"]
