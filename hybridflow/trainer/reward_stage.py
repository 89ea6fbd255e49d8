"""The reward stage of the driver loop: each step's outcome scores (`token_level_scores`) and, for an estimator
that takes them, dense process rewards from a reward model trained online beside the actor (PRIME's implicit PRM).

`RayPPOTrainer` holds one stage, built by `build_reward_stage` from what the run's estimator needs, and calls it
the same way for every algorithm: `score_into` after generation, `process_rewards` before the advantage, and
`save_checkpoint` / `load_checkpoint` with the other models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.algorithms.prime import implicit_token_rewards, prime_dpo_accuracy, prime_normalize
from hybridflow.protocol import DataProto
from hybridflow.rewards.combine import combine_rewards
from hybridflow.rewards.manager.base import RewardResult, checked_reward_result
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.scaffold import timer, worker_metrics


class RewardStage:
    """Outcome rewards: the rule-based reward manager's (`reward_fn`), the reward model's score, or both weighted by
    `reward_model.rule_reward_coef`."""

    def __init__(self, reward_fn: Any, reward_model: Any, rule_reward_coef: float) -> None:
        """`reward_model` is the reward-model worker group scoring outcomes, or None."""
        self.reward_fn, self.reward_model, self.rule_reward_coef = reward_fn, reward_model, rule_reward_coef

    def score(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> RewardResult:
        """Rewards of `batch`: the reward model's score (`rm`), the rule-based reward manager's (`reward`), or
        both weighted by `reward_model.rule_reward_coef`."""
        if self.reward_model is None:
            with timer("reward", timing):
                reward = checked_reward_result(self.reward_fn, self.reward_fn(batch), len(batch))
            metrics.update(reward.metrics)
            return reward
        with timer("rm", timing):
            scored = self.reward_model.compute_rm_score(batch).batch
        rm_scores = scored["rm_scores"]
        if "rm_input_truncated" in scored.keys():  # conversations past reward_model.max_length lost their start
            metrics["reward_model/truncated_ratio"] = float(scored["rm_input_truncated"].float().mean())
        rule = None
        if self.rule_reward_coef != 0:
            with timer("reward", timing):
                rule = checked_reward_result(self.reward_fn, self.reward_fn(batch), len(batch))
        reward = combine_rewards(rm_scores, rule, self.rule_reward_coef)
        metrics.update(reward.metrics)
        return reward

    def score_into(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> RewardResult:
        """Score `batch` and store its `token_level_scores` (bs, response_len)."""
        reward = self.score(batch, metrics, timing)
        batch.batch["token_level_scores"] = reward.reward_tensor
        return reward

    def process_rewards(
        self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]
    ) -> dict[str, Any] | None:
        """The advantage estimator's extra inputs beyond the outcome rewards: none for outcome rewards."""
        return None

    def save_checkpoint(self, directory: Path) -> None:
        """Nothing to save: no model of this stage trains."""

    def load_checkpoint(self, directory: Path) -> None:
        """Nothing to load: no model of this stage trains."""


class ImplicitPRMStage(RewardStage):
    """PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): the outcome rewards are the rule
    rewards, which also label each sample (`acc`); the implicit PRM learns from these labels online and its
    log-ratios become dense token rewards (`rm_scores`) for the `prime` estimator."""

    def __init__(self, reward_fn: Any, prm: Any, config: PPOConfig) -> None:
        super().__init__(reward_fn, None, config.reward_model.rule_reward_coef)  # the PRM scores no outcome
        self.prm, self.section, self.algorithm = prm, config.reward_model, config.algorithm

    def score_into(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> RewardResult:
        """The outcome scores, and each sample's outcome label `acc` (bs,) in [0, 1] that the implicit PRM learns."""
        reward = super().score_into(batch, metrics, timing)
        batch.batch["acc"] = torch.tensor(reward.extra_info["acc"], dtype=torch.float32).clamp(0.0, 1.0)
        return reward

    def process_rewards(
        self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]
    ) -> dict[str, Any] | None:
        """Train the implicit PRM on this batch's outcomes (before or after it scores the batch, as
        `reward_model.model.update` says), turn its log-ratios into dense token rewards (`rm_scores`), and return
        the advantage's extra inputs."""
        with timer("prime_rm", timing):
            prm, section = self.prm, self.section
            batch = batch.union(self._collect(prm.compute_ref_log_prob(batch), metrics))  # once, for both calls
            if section.model.update == "before":
                self._collect(prm.update_rm(batch), metrics)
            q = self._collect(prm.compute_rm_score(batch), metrics).batch["prime_q"]
            if section.model.update == "after":
                self._collect(prm.update_rm(batch), metrics)
            mask = batch.batch["response_mask"]
            scores = implicit_token_rewards(q, mask, section.model.beta_train, section.prime_granularity)
            batch.batch["rm_scores"] = prime_normalize(scores, section.prime_norm)
            uid = batch.non_tensor_batch["uid"]
            metrics["reward_model/dpo_acc"] = prime_dpo_accuracy(q, batch.batch["acc"], mask, uid)
            metrics["reward_model/implicit_reward/mean"] = float((q * mask).sum(-1).mean()) * section.model.beta_train
        return {"rm_scores": batch.batch["rm_scores"], "reward_dpo_coef": self.algorithm.reward_dpo_coef,
                "reward_gt_coef": self.algorithm.reward_gt_coef}

    def save_checkpoint(self, directory: Path) -> None:
        """The implicit PRM's shards under `directory/reward`."""
        self.prm.save_checkpoint(str(directory / "reward"))

    def load_checkpoint(self, directory: Path) -> None:
        """The implicit PRM's shards from `directory/reward`."""
        self.prm.load_checkpoint(str(directory / "reward"))

    @staticmethod
    def _collect(output: DataProto, metrics: dict[str, float]) -> DataProto:
        metrics.update(worker_metrics(output))
        return output


def build_reward_stage(config: PPOConfig, reward_fn: Any, reward_model: Any) -> RewardStage:
    """The stage the run's estimator needs: PRIME's implicit PRM, or outcome rewards (`reward_model`: the
    reward-model worker group, or None)."""
    if config.estimator.implicit_prm:
        return ImplicitPRMStage(reward_fn, reward_model, config)
    return RewardStage(reward_fn, reward_model, config.reward_model.rule_reward_coef)
