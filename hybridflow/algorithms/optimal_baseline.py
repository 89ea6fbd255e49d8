"""The optimal token baseline (OTB, verl's `optimal_token_baseline` and `tir_optimal_token_baseline` estimators) and
the gradient-variance proxies that read the same per-token energy.

For each prompt group and response position t the baseline is the energy-weighted mean of the group's returns,

    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps),   W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_v^2) [* rho_j^2],

where G_t is the reward-to-go, pi_j the probability the old policy gave the sampled token and sum_v pi_v^2 its
distribution's sum of squared probabilities (the actor's `calculate_sum_pi_squared`): 1 - 2 pi_j + sum pi^2 is the
squared norm of the log-prob's gradient with respect to the logits, so W_t is the path's accumulated
gradient energy ("logit-gradient proxy"). With the rollout's truncated importance weights rho, W is scaled by
rho^2. The advantage is G_t - B_t on response tokens. A group of one has no baseline (its advantage is its
return). The multi-turn (tool-integrated) form counts t over the model's own tokens only, skipping the tool
outputs between turns, so that position t of two trajectories is their t-th generated token.

Everything is vectorised over the batch (index_add over group ids), as verl's loops compute it.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms.advantages import _group_ids
from hybridflow.algorithms.masked import masked_mean

__all__ = [
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "token_energy",
    "variance_proxy_metrics",
]


def token_energy(
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token squared norm of the log-prob's logit gradient, `1 - 2 pi + sum pi^2` (bs, response_len), times
    the squared importance weight when given."""
    energy = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    return energy if rollout_is_weights is None else energy * rollout_is_weights**2


def _returns_and_path_energy(
    rewards: torch.Tensor, response_mask: torch.Tensor, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, reward-to-go G_t, accumulated energy W_t), each (bs, response_len), over response tokens."""
    mask = response_mask.to(rewards.dtype)
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    energy = (token_energy(old_log_probs, sum_pi_squared, rollout_is_weights) * mask).cumsum(dim=-1)
    return mask, returns, energy


def _weighted_group_baselines(
    returns: torch.Tensor, weights: torch.Tensor, member: torch.Tensor, gid: torch.Tensor, num_groups: int,
    epsilon: float,
) -> torch.Tensor:
    """(bs, T): sum over the members of each row's group of returns * weights / (sum of weights + eps), 0 for rows
    whose group has fewer than two members (`member` (bs,) bool: rows that count)."""
    rows = member.to(returns.dtype).unsqueeze(-1)
    numerator = returns.new_zeros(num_groups, returns.size(-1)).index_add_(0, gid, returns * weights * rows)
    denominator = returns.new_zeros(num_groups, returns.size(-1)).index_add_(0, gid, weights * rows) + epsilon
    size = torch.zeros(num_groups, dtype=torch.long, device=gid.device).index_add_(0, gid, member.long())
    return (numerator / denominator)[gid] * (size[gid] > 1).unsqueeze(-1).to(returns.dtype)


def _zero_unique_tail(
    baselines: torch.Tensor, lengths: torch.Tensor, member: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Zero the baseline of a group's longest trajectory past the second-longest one's length, where that longest
    trajectory is the only one of its length (no other trajectory estimates the baseline there)."""
    absent = torch.full_like(lengths, -1)
    masked_lengths = torch.where(member, lengths, absent)
    longest = absent.new_full((num_groups,), -1).scatter_reduce(0, gid, masked_lengths, "amax")
    at_longest = member & (lengths == longest[gid])
    ties = torch.zeros(num_groups, dtype=torch.long, device=gid.device).index_add_(0, gid, at_longest.long())
    shorter = torch.where(member & ~at_longest, lengths, absent)
    second = absent.new_full((num_groups,), -1).scatter_reduce(0, gid, shorter, "amax")
    unique = at_longest & (ties[gid] == 1) & (second[gid] >= 0)
    columns = torch.arange(baselines.size(-1), device=baselines.device)
    tail = unique.unsqueeze(-1) & (columns >= second[gid].unsqueeze(-1))
    return baselines.masked_fill(tail, 0.0)


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB advantages `(G_t - B_t) * mask` and returns `G_t` (bs, response_len), position t counted over the whole
    response (see the module docstring).

    Args:
        token_level_rewards, response_mask: (bs, response_len).
        index: (bs,) prompt group ids.
        old_log_probs: (bs, response_len) the old policy's log-probs of the sampled tokens.
        sum_pi_squared: (bs, response_len) sum_v pi_v^2 of the same distributions.
        rollout_is_weights: (bs, response_len) truncated importance weights, or None.
        handle_zero_tail: zero the baseline of a group's uniquely longest trajectory past the second-longest.
        epsilon: added to the weights' sum.
    """
    with torch.no_grad():
        mask, returns, energy = _returns_and_path_energy(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        gid, num_groups = _group_ids(index, returns.device)
        everyone = torch.ones(returns.size(0), dtype=torch.bool, device=returns.device)
        baselines = _weighted_group_baselines(returns, energy * mask, everyone, gid, num_groups, epsilon)
        if handle_zero_tail:
            lengths = response_mask.sum(dim=-1).long()
            baselines = _zero_unique_tail(baselines, lengths, everyone, gid, num_groups)
        advantages = (returns - baselines) * mask
    return advantages, returns


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tool-integrated OTB (`tir_optimal_token_baseline`): as `compute_optimal_token_baseline_advantage`, with
    position t counted over each trajectory's own response tokens (mask 1) only, so tool outputs between turns
    do not shift one trajectory's positions against another's; trajectories without a response token take no
    part in their group. Same arguments; `handle_zero_tail` defaults to True, as verl's."""
    with torch.no_grad():
        mask, returns, energy = _returns_and_path_energy(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        # column of each response token among its row's response tokens (non-response positions add zeros)
        slot = (response_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        compact_returns = torch.zeros_like(returns).scatter_add_(1, slot, returns * mask)
        compact_energy = torch.zeros_like(energy).scatter_add_(1, slot, energy * mask)
        lengths = response_mask.sum(dim=-1).long()
        member = lengths > 0
        gid, num_groups = _group_ids(index, returns.device)
        baselines = _weighted_group_baselines(compact_returns, compact_energy, member, gid, num_groups, epsilon)
        if handle_zero_tail:
            baselines = _zero_unique_tail(baselines, lengths, member, gid, num_groups)
        advantages = (compact_returns - baselines).gather(1, slot) * mask
    return advantages, returns


def variance_proxy_metrics(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """verl's gradient-variance proxies from the logit-gradient energy W(tau) = sum_t (1 - 2 pi_t + sum pi^2):

    - `variance_proxy/proxy1_signal_strength`: ||g||^2 of the batch's mean gradient (the update's grad norm
      squared; 0 when not given);
    - `variance_proxy/proxy2_total_power`: E[A^2 W] over trajectories (A the mean advantage over the response),
      with the rollout's importance weights E[rho^2 A^2 W] (rho their mean over the response);
    - `variance_proxy/proxy3_pure_noise`: (proxy2 - proxy1) / (N - 1), floored at 0 (0 without a grad norm);
    - `variance_proxy/expected_a_squared`, `variance_proxy/expected_w`: E[A^2] and E[W], W with rho^2 when given.
    """
    mask = response_mask.to(advantages.dtype)
    energy = token_energy(old_log_probs, sum_pi_squared)
    scaled = energy if rollout_is_weights is None else energy * rollout_is_weights**2
    mean_advantage = masked_mean(advantages, mask, axis=-1)
    w_values = (scaled * mask).sum(dim=-1)
    if rollout_is_weights is None:
        total_power = (mean_advantage**2 * w_values.clamp(min=0.0)).mean()
    else:  # W recovered from the scaled energy as verl does (a token whose weight is 0 adds nothing)
        plain_w = (scaled / (rollout_is_weights**2).clamp(min=1e-10) * mask).sum(dim=-1).clamp(min=0.0)
        mean_weight = masked_mean(rollout_is_weights, mask, axis=-1)
        total_power = (mean_weight**2 * mean_advantage**2 * plain_w).mean()
    signal = grad_norm**2 if grad_norm is not None else None
    num = advantages.size(0)
    noise = max(0.0, (float(total_power) - signal) / (num - 1)) if signal is not None and num > 1 else 0.0
    return {
        "variance_proxy/proxy1_signal_strength": signal if signal is not None else 0.0,
        "variance_proxy/proxy2_total_power": float(total_power),
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": float((mean_advantage**2).mean()),
        "variance_proxy/expected_w": float(w_values.mean()),
    }
