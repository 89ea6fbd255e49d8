"""PRIME (arXiv:2502.01456): an implicit process reward model trained online from outcome labels.

The implicit PRM is a causal LM `pi_phi`; its token reward is `r_t = beta * (log pi_phi(y_t) - log pi_ref(y_t))`.
It learns from outcomes only: the sequence's implicit reward `beta * sum_t q_t` is pushed through a sigmoid toward
the verifier's 0/1 label (cross-entropy). The policy's advantage sums leave-one-out (RLOO) baselines of both reward
sources (dense implicit rewards and the outcome), takes returns as reverse cumulative sums and whitens them.
Names and numbers follow verl's PRIME recipe (`reward_dpo_coef`, `reward_gt_coef`, `prime_granularity`,
`prime_norm`, `beta_train`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from hybridflow.algorithms.advantages import _group_ids
from hybridflow.algorithms.masked import masked_whiten

__all__ = [
    "compute_prime_advantage_return",
    "implicit_token_rewards",
    "last_token_mask",
    "prime_ce_loss",
    "prime_dpo_accuracy",
    "prime_normalize",
]

Granularity = Literal["token", "whole"]


def implicit_token_rewards(
    q: torch.Tensor, response_mask: torch.Tensor, beta: float, granularity: Granularity = "token"
) -> torch.Tensor:
    """Token rewards from q = log pi_prm - log pi_ref (bs, response_len): beta * q on every response token
    (`token`), or beta * sum q on each row's last response token (`whole`)."""
    q = q * response_mask.to(q.dtype)
    if granularity == "token":
        return q * beta
    if granularity == "whole":
        return last_token_mask(response_mask).to(q.dtype) * (q.sum(-1, keepdim=True) * beta)
    raise ValueError(f"prime_granularity={granularity!r} is not known; use 'token' or 'whole'")


def prime_normalize(scores: torch.Tensor, mode: Literal["batch_norm", "none"]) -> torch.Tensor:
    """verl's `prime_norm`: `batch_norm` divides by the largest |reverse cumulative sum| in the batch (the largest
    return the rewards can add up to), `none` leaves them."""
    if mode == "none":
        return scores
    if mode == "batch_norm":
        reverse_cumsum = scores.flip(-1).cumsum(-1).flip(-1)
        return scores / (reverse_cumsum.abs().max() + 1e-6)
    raise ValueError(f"prime_norm={mode!r} is not known; use 'batch_norm' or 'none'")


def prime_ce_loss(q: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Cross-entropy of sigmoid(beta * sum_t q_t) against the outcome label `acc` (bs,) in [0, 1], mean over rows."""
    logits = (q * response_mask.to(q.dtype)).sum(-1) * beta
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, acc.to(logits.dtype))


def prime_dpo_accuracy(q: torch.Tensor, acc: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray) -> float:
    """How often the implicit rewards order two samples of one prompt as their outcomes do, weighted by the
    outcome gap (pairs with equal outcomes do not count; a group without any counts 0.5), mean over groups."""
    totals = (q * response_mask.to(q.dtype)).sum(-1)
    gid, num_groups = _group_ids(index, q.device)
    accuracies = []
    for group in range(num_groups):
        members = (gid == group).nonzero().flatten()
        score_diff = totals[members, None] - totals[None, members]
        acc_diff = acc[members, None].to(totals.dtype) - acc[None, members].to(totals.dtype)
        upper = torch.ones_like(score_diff, dtype=torch.bool).triu(diagonal=1)
        score_diff, acc_diff = score_diff[upper], acc_diff[upper]
        weight = acc_diff.abs().sum()
        if weight == 0:
            accuracies.append(0.5)
        else:
            agree = ((score_diff > 0) == (acc_diff > 0)).to(totals.dtype)
            accuracies.append(float((agree * acc_diff.abs()).sum() / weight))
    return float(np.mean(accuracies)) if accuracies else 0.5


def last_token_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """(bs, response_len) bool: True at each row's last response token (none for an empty response)."""
    positions = torch.arange(response_mask.size(-1), device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=-1).values
    return (positions[None, :] == last[:, None]) & (last[:, None] >= 0)


def _masked_rloo(rewards: torch.Tensor, mask: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each masked reward times n/(n-1) minus the group's sum of per-sample mean rewards over (n-1) (verl's
    `masked_rloo`); samples of a singleton group keep their rewards."""
    maskf = mask.to(rewards.dtype)
    per_sample = (rewards * maskf).sum(-1) / maskf.sum(-1).clamp(min=1)
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, gid, torch.ones_like(per_sample)
    )
    group_sum = torch.zeros_like(count).index_add_(0, gid, per_sample)
    n = count[gid][:, None]
    loo = rewards * n / (n - 1).clamp(min=1) - group_sum[gid][:, None] / (n - 1).clamp(min=1)
    return torch.where(mask.bool(), torch.where(n > 1, loo, rewards), 0.0)


def compute_prime_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    rm_scores: torch.Tensor | None = None,
    reward_dpo_coef: float = 5.0,
    reward_gt_coef: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantage (verl recipe's `compute_rloo_advantage_return`).

    Args:
        token_level_rewards: (bs, response_len) outcome rewards (each row's verifier score on its last token).
        response_mask: (bs, response_len).
        index: (bs,) group ids (uids).
        rm_scores: (bs, response_len) implicit PRM token rewards; None (or reward_dpo_coef=0) uses outcomes only.
        reward_dpo_coef, reward_gt_coef: weights of the implicit and the outcome rewards.

    Returns:
        (advantages, returns): returns = reverse cumsum of the summed RLOO rewards; advantages = them, whitened.
    """
    with torch.no_grad():
        gid, num_groups = _group_ids(index, response_mask.device)
        mask = response_mask.bool()
        combined = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        if rm_scores is not None and reward_dpo_coef != 0:
            combined = combined + _masked_rloo(rm_scores.float(), mask, gid, num_groups) * reward_dpo_coef
        if reward_gt_coef != 0:
            last = last_token_mask(response_mask)
            outcome = torch.where(last, token_level_rewards.sum(-1, keepdim=True).float(), 0.0)
            combined = combined + _masked_rloo(outcome, last, gid, num_groups) * reward_gt_coef
        returns = (combined * response_mask).flip(-1).cumsum(-1).flip(-1)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns
