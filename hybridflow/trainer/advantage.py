"""Driver-side glue from a `DataProto` to the pure advantage and KL functions in `hybridflow.algorithms`."""

from __future__ import annotations

import torch

from hybridflow.algorithms import apply_kl_penalty, compute_advantage_by_name
from hybridflow.algorithms.kl import KLController
from hybridflow.algorithms.optimal_baseline import variance_proxy_metrics
from hybridflow.algorithms.pf_ppo import pf_ppo_resample_indices
from hybridflow.protocol import DataProto


def compute_advantage(
    data: DataProto,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    extra_inputs: dict | None = None,
) -> DataProto:
    """Add `advantages` and `returns` (bs, response_len) computed by the registered `adv_estimator`.

    Reads `token_level_rewards`, `response_mask`, `values` (if present) and the `uid` group ids, and passes
    `old_log_probs`, `sum_pi_squared` and `rollout_is_weights` when the batch has them (the optimal token baseline
    reads them); `extra_inputs` go to estimators that name them (PRIME's `rm_scores` and coefficients).
    """
    batch = data.batch
    optional = ("old_log_probs", "sum_pi_squared", "rollout_is_weights")
    present = {key: batch[key] for key in optional if key in batch.keys()}
    advantages, returns = compute_advantage_by_name(
        adv_estimator,
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        index=data.non_tensor_batch.get("uid"),
        values=batch["values"] if "values" in batch.keys() else None,
        reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch.keys() else None,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        extra_inputs={**present, **(extra_inputs or {})},
    )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data


def apply_kl_in_reward(data: DataProto, kl_ctrl: KLController, kl_penalty: str) -> dict[str, float]:
    """Set `token_level_rewards` = scores - beta * KL(old || ref) and update the controller; return metrics."""
    batch = data.batch
    rewards, metrics = apply_kl_penalty(
        batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"], kl_ctrl, kl_penalty
    )
    batch["token_level_rewards"] = rewards
    return metrics


def apply_pf_ppo(data: DataProto, reweight_method: str, weight_pow: float, seed: int) -> tuple[DataProto, dict[str, float]]:
    """PF-PPO: the batch resampled with replacement by its samples' summed reward scores (same size, tensors and
    per-sample columns alike); metrics say how many distinct samples it kept and the mean score before and after.
    `seed` makes the draw reproducible (and different every step)."""
    scores = data.batch["token_level_scores"].sum(-1)
    generator = torch.Generator().manual_seed(seed)
    indices = pf_ppo_resample_indices(scores.cpu(), reweight_method, weight_pow, generator)
    resampled = data.select_idxs(indices)
    metrics = {
        "pf_ppo/unique_fraction": float(indices.unique().numel() / max(len(indices), 1)),
        "pf_ppo/score_mean_before": float(scores.float().mean()),
        "pf_ppo/score_mean_after": float(scores.cpu()[indices].float().mean()),
    }
    return resampled, metrics


def variance_proxies(data: DataProto, grad_norm: float | None) -> dict[str, float]:
    """verl's `variance_proxy/*` metrics of a step whose batch holds `sum_pi_squared` (see `variance_proxy_metrics`);
    `grad_norm` is the actor update's."""
    batch = data.batch
    return variance_proxy_metrics(
        batch["old_log_probs"], batch["sum_pi_squared"], batch["advantages"], batch["response_mask"],
        rollout_is_weights=batch["rollout_is_weights"] if "rollout_is_weights" in batch.keys() else None,
        grad_norm=grad_norm,
    )
