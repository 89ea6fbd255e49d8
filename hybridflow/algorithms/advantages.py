"""Advantage estimators and their registry (`algorithm.adv_estimator=<name>`).

Every estimator is a pure function returning `(advantages, returns)`, both (bs, response_len) and zero
where `response_mask` is 0. Names, argument names and numbers follow verl's `core_algos`; a custom
estimator written for verl registers here with `@register_adv_est("my_est")` unchanged. The registry
and each estimator's spec (what it needs from the run) live in `estimator_registry`, which registers
the functions below by name without importing torch.

Group-based estimators take `index`, a numpy object array of group ids (the `uid` column: all
responses to the same prompt share one id). Groups are formed by equality of ids, in any order.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.estimator_registry import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    EstimatorSpec,
    estimator_name,
    estimator_spec,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.masked import masked_whiten

__all__ = [
    "AdvantageEstimator",
    "ADV_ESTIMATORS",
    "EstimatorSpec",
    "estimator_spec",
    "register_adv_est",
    "get_adv_estimator_fn",
    "compute_advantage_by_name",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_gpg_outcome_advantage",
]


def compute_advantage_by_name(
    adv_estimator: str | AdvantageEstimator,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    extra_inputs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch by name: call the registered estimator with the inputs its signature names.

    The driver calls this once per step with everything it has; each estimator receives only the
    arguments it declares (all of them if it takes `**kwargs`). `None` inputs are treated as absent.

    Args:
        adv_estimator: registered name (`"gae"`, `"grpo"`, ...).
        token_level_rewards: (bs, response_len).
        response_mask: (bs, response_len).
        index: (bs,) numpy object array of group ids (uids), for group estimators.
        values: (bs, response_len) critic values, for `gae`.
        reward_baselines: (bs,) greedy-response rewards, for `remax`.
        gamma, lam: discount and GAE lambda (`algorithm.gamma`, `algorithm.lam`).
        norm_adv_by_std_in_grpo: divide by the group std (`algorithm.norm_adv_by_std_in_grpo`).
        extra_inputs: further named inputs for custom estimators (e.g. `{"config": algo_cfg}`).

    Returns:
        (advantages, returns), both (bs, response_len).

    Raises:
        TypeError: the estimator needs an input that was not given (the message names it).
    """
    fn = get_adv_estimator_fn(adv_estimator)
    available: dict[str, Any] = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "index": index,
        "values": values,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        **(extra_inputs or {}),
    }
    available = {k: v for k, v in available.items() if v is not None}
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = available if takes_var_kw else {k: v for k, v in available.items() if k in params}
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name not in kwargs
    ]
    if missing:
        raise TypeError(f"advantage estimator {estimator_name(adv_estimator)!r} needs {missing}, which were not given")
    return check_estimator_result(estimator_name(adv_estimator), fn(**kwargs), tuple(token_level_rewards.shape))


def check_estimator_result(name: str, result: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An estimator's `(advantages, returns)`, each a tensor of the rewards' (bs, response_len) shape, or an error
    naming the estimator and its contract (a (bs,) result would broadcast along the tokens in the loss)."""
    contract = f"advantage estimator {name!r} must return (advantages, returns), each a tensor of shape {shape}"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"{contract}; it returned {type(result).__name__}")
    for what, value in zip(("advantages", "returns"), result):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{contract}; its {what} are {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"{contract}; its {what} have shape {tuple(value.shape)} (a per-sequence value goes on "
                             "every response token: value.unsqueeze(-1) * response_mask)")
    return result


# --------------------------------------------------------------------------------------------------
# helpers


def _group_ids(index: np.ndarray | list, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to 0..G-1 in order of first appearance: ((bs,) int64, G)."""
    table: dict[Any, int] = {}
    ids = [table.setdefault(uid, len(table)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(table)


def _group_stats(scores: torch.Tensor, gid: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-group (count, mean, unbiased std) of `scores` (bs,); singleton groups get mean 0, std 1."""
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, gid, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count, mean, std


# --------------------------------------------------------------------------------------------------
# estimators


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015), multi-turn aware, then whitened.

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`, computed right to left.
    Positions with `response_mask == 0` are skipped by the recursion: they pass the next model token's
    value and advantage through unchanged, so in a multi-turn rollout the tool/observation tokens
    between two model turns do not break the chain (as verl's GAE). `returns = A + V` before
    whitening; the advantages are then whitened over the mask.

    Args:
        token_level_rewards: (bs, response_len).
        values: (bs, response_len) critic values of the rollout.
        response_mask: (bs, response_len); 1 = model token, 0 = padding or observation token.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        (advantages, returns), both (bs, response_len), zero where the mask is 0 (verl leaves the
        carried values there; they never enter a loss).
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_values = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages_reversed = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
            advantages_reversed.append(last_gae)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, response_mask) * mask
    return advantages, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024): `(s - mean_g) / (std_g + epsilon)` broadcast over tokens.

    `s` is the sequence score `sum_t r_t`; mean and unbiased std are over the group `g` of responses
    sharing an id in `index`. A singleton group uses mean 0 and std 1. With
    `norm_adv_by_std_in_grpo=False` the advantage is `s - mean_g` (Dr. GRPO, arXiv:2503.20783).

    Args:
        token_level_rewards: (bs, response_len).
        response_mask: (bs, response_len).
        index: (bs,) group ids.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, num_groups = _group_ids(index, scores.device)
        _, mean, std = _group_stats(scores, gid, num_groups)
        adv = scores - mean[gid]
        if norm_adv_by_std_in_grpo:
            adv = adv / (std[gid] + epsilon)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (arXiv:2503.19595): only the best response of each group gets `r_max - r_second`.

    With `norm_adv_by_std_in_grpo` that value is divided by `(std_g + epsilon)` (unbiased std of the
    group's scores). All other responses get 0. Among tied best responses the first in batch order wins.

    Args:
        token_level_rewards: (bs, response_len).
        response_mask: (bs, response_len).
        index: (bs,) group ids; every group needs at least 2 responses.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.

    Raises:
        ValueError: a group has a single response.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = torch.zeros_like(scores)
        gid, num_groups = _group_ids(index, scores.device)
        for g in range(num_groups):
            members = torch.nonzero(gid == g, as_tuple=True)[0]
            rewards = scores[members]
            if rewards.numel() < 2:
                raise ValueError(
                    f"grpo_passk needs at least 2 responses per group (rollout.n >= 2); group "
                    f"{index[int(members[0])]!r} has {rewards.numel()}"
                )
            order = torch.sort(rewards, descending=True, stable=True).indices
            advantage = rewards[order[0]] - rewards[order[1]]
            if norm_adv_by_std_in_grpo:
                advantage = advantage / (torch.std(rewards) + epsilon)
            advantages[members[order[0]]] = advantage
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): leave-one-out baseline, `A_i = s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_g)`.

    A singleton group keeps its raw score as advantage (as verl). `epsilon` is accepted for signature
    compatibility and unused.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, num_groups = _group_ids(index, scores.device)
        count, mean, _ = _group_stats(scores, gid, num_groups)
        n = count[gid]
        loo = scores * n / (n - 1).clamp(min=1) - mean[gid] * n / (n - 1).clamp(min=1)
        adv = torch.where(n > 1, loo, scores).unsqueeze(-1) * response_mask
    return adv, adv


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): length-weighted group baseline, `A_i = s_i - sum_j(l_j s_j) / sum_j l_j`.

    `l_j` is the response length (`response_mask.sum(-1)`). A singleton group has baseline 0.
    `epsilon` is unused.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        gid, num_groups = _group_ids(index, scores.device)
        count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
            0, gid, torch.ones_like(scores)
        )
        weighted = torch.zeros_like(count).index_add_(0, gid, lengths * scores)
        total_len = torch.zeros_like(count).index_add_(0, gid, lengths)
        baseline = torch.where(count > 1, weighted / total_len, torch.zeros_like(weighted))
        adv = (scores - baseline[gid]).unsqueeze(-1) * response_mask
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    `G_t = r_t + gamma * G_{t+1}` over model tokens. Positions with mask 0 are skipped: their reward is
    ignored and the running return passes through them unchanged, so in a multi-turn rollout a later
    turn's reward reaches earlier turns across the observation tokens (as verl). `A = whiten(G)`
    over the mask.

    Args:
        token_level_rewards: (bs, response_len).
        response_mask: (bs, response_len).
        gamma: discount (`algorithm.gamma`).

    Returns:
        (advantages, returns), (bs, response_len), masked.
    """
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * response_mask[:, t]
            running = candidate * response_mask[:, t] + running * (1 - response_mask[:, t])
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean score, then whiten over the whole batch.

    `A = whiten((s_i - mean_g) * mask)` with the statistics over all masked tokens of the batch
    (a singleton group has mean 0). `epsilon` is unused.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, num_groups = _group_ids(index, scores.device)
        _, mean, _ = _group_stats(scores, gid, num_groups)
        centred = (scores - mean[gid]).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
        adv = masked_whiten(centred, response_mask) * response_mask
    return adv, adv


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): return-to-go minus the reward of the greedy response.

    `G_t = sum_{t' >= t} r_t' * mask_t'`, `A_t = G_t - b` with `b` the score of the greedy (argmax)
    decode of the same prompt, which the trainer generates and scores.

    Args:
        token_level_rewards: (bs, response_len).
        reward_baselines: (bs,) greedy-response scores.
        response_mask: (bs, response_len).

    Returns:
        (advantages, returns), (bs, response_len), masked.
    """
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns * response_mask


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546): `A_i = alpha * (s_i - mean_g) / f_norm` with `alpha = bs / #(s != 0)`.

    `alpha` is always recomputed from the batch as in verl (the argument is kept for signature
    compatibility); a singleton group has mean 0. `epsilon` is unused.

    Returns:
        (advantages, returns), identical, (bs, response_len), masked.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        gid, num_groups = _group_ids(index, scores.device)
        _, mean, _ = _group_stats(scores, gid, num_groups)
        adv = (alpha * (scores - mean[gid]) / f_norm).unsqueeze(-1) * response_mask
    return adv, adv
