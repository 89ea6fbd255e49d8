"""Joining a learned reward model's scores with rule-based rewards (`reward_model.rule_reward_coef`)."""

from __future__ import annotations

import torch

from hybridflow.rewards.manager.base import RewardResult

__all__ = ["combine_rewards"]


def combine_rewards(rm_scores: torch.Tensor, rule: RewardResult | None, rule_reward_coef: float) -> RewardResult:
    """`rm_scores + rule_reward_coef * rule scores` (both (bs, response_len), each score on the last response
    token); without `rule` the reward model's scores alone. The rule manager's per-sample columns (acc, score)
    and counts are kept, and `reward/rm_score/mean` and `reward/rule_score/mean` are logged apart."""
    metrics = {"reward/rm_score/mean": float(rm_scores.sum(dim=-1).mean())}
    if rule is None:
        return RewardResult(reward_tensor=rm_scores, extra_info={"rm_score": rm_scores.sum(dim=-1).tolist()},
                            metrics=metrics)
    rule_scores = rule.reward_tensor.to(rm_scores.dtype)
    metrics.update(rule.metrics)
    metrics["reward/rule_score/mean"] = float(rule_scores.sum(dim=-1).mean())
    extra_info = dict(rule.extra_info)
    extra_info["rm_score"] = rm_scores.sum(dim=-1).tolist()
    return RewardResult(reward_tensor=rm_scores + rule_reward_coef * rule_scores, extra_info=extra_info, metrics=metrics)
