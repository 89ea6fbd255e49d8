"""The registered policy losses (`actor_rollout_ref.actor.policy_loss.loss_mode=<name>`).

Each registered loss has verl's calling convention minus the config object:

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       rollout_is_weights=None, *, <hyper-parameters with defaults>,
       dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    -> (loss, metrics)

- All token tensors are (bs, response_len); `loss` is a 0-dim tensor.
- `metrics` is a dict of detached 0-dim tensors keyed as verl logs them: `actor/pg_clipfrac`, `actor/ppo_kl`,
  `actor/pg_clipfrac_lower` (the same key set per loss as verl; `gpg` returns none). They stay on the device:
  the engine reduces them once per mini-batch, so a micro-batch never waits for the accelerator (verl calls
  `.item()` here, one synchronisation per metric and micro-batch).
- No loss reads a value back to the host: data-dependent counts (Clip-Cov's and KL-Cov's token budgets) are
  device tensors, and tokens are selected by rank rather than by a host-sized `topk` / `nonzero`.
- `rollout_is_weights` (bs, response_len), optional: rollout-correction importance weights that
  multiply the per-token loss before aggregation (they are treated as constants).
- `dp_size`, `batch_num_tokens`, `global_batch_size`, `loss_scale_factor` go to `agg_loss` (see there)
  and make the loss independent of micro-batching and data-parallel size.

The keyword defaults come from `PPOLossConfig` (one place); `compute_policy_loss_from_config` in
`policy_loss_registry.py` dispatches by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.config import PPOLossConfig
from hybridflow.algorithms.policy_loss_registry import loss_hyperparameters

__all__ = [
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_geo_mean",
]

_D = SimpleNamespace(**loss_hyperparameters(PPOLossConfig()))  # the single source of the keyword defaults below


def _clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _floats(**metrics: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics under verl's keys, detached 0-dim tensors (read on the host once per mini-batch)."""
    return {f"actor/{k}": v.detach() for k, v in metrics.items()}


def _rank_in(keys: torch.Tensor) -> torch.Tensor:
    """Each entry's 0-based rank in ascending order of `keys` (ties by position), same shape."""
    flat = keys.reshape(-1)
    ranks = torch.empty_like(flat, dtype=torch.long)
    ranks[torch.argsort(flat, stable=True)] = torch.arange(flat.numel(), device=flat.device)
    return ranks.view(keys.shape)


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = _D.clip_ratio,
    clip_ratio_low: float | None = _D.clip_ratio_low,
    clip_ratio_high: float | None = _D.clip_ratio_high,
    clip_ratio_c: float = _D.clip_ratio_c,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (arXiv:1707.06347) with asymmetric clipping and dual-clip.

    `r = exp(clamp(logp - old_logp, -20, 20))`;
    `l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`; for `A < 0` additionally
    `l = min(l, -A c)` (dual-clip, arXiv:1912.09729). `eps_high > eps_low` is DAPO's clip-higher.

    Metrics: `pg_clipfrac` (share of tokens where the clipped term is active), `ppo_kl`
    (masked mean of `old_logp - logp`), `pg_clipfrac_lower` (share hitting the dual-clip bound).

    Raises:
        ValueError: `clip_ratio_c <= 1`.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return loss, _floats(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = _D.clip_ratio,
    clip_ratio_low: float | None = _D.clip_ratio_low,
    clip_ratio_high: float | None = _D.clip_ratio_high,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (arXiv:2507.18071): PPO clipping on the sequence-level, length-normalised ratio.

    `s_i = exp(mean_t(logp - old_logp))` over the response; per token the ratio is
    `s_i,t = sg[s_i] * pi / sg[pi]` (value `s_i`, gradient `s_i * grad logp_t`), log-clamped at 10.
    `l = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))`, aggregated with `loss_agg_mode` (the paper
    uses `seq-mean-token-mean`; set `actor.loss_agg_mode` to it, as the worker passes that key).

    Typical setting: `clip_ratio_low=3e-4, clip_ratio_high=4e-4`.
    """
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    log_ratio_seq = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths

    log_seq_ratio = log_prob - log_prob.detach() + log_ratio_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return loss, _floats(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=torch.zeros(()))


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    tau_pos: float = _D.tau_pos,
    tau_neg: float = _D.tau_neg,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (arXiv:2511.20347): a smooth sigmoid gate replaces hard clipping.

    `r = exp(clamp(logp - old_logp, -20, 20))`, `tau = tau_pos if A > 0 else tau_neg`,
    `f(r) = sigmoid(tau (r - 1)) * 4 / tau`, `l = -f(r) A`; aggregated with `seq-mean-token-mean`
    as in verl (`loss_agg_mode` is ignored). At `r = 1` the gradient equals the plain policy gradient.
    """
    del loss_agg_mode  # verl aggregates SAPO per sequence
    tau_p = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_n = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, tau_p, tau_n)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, "seq-mean-token-mean", dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    ppo_kl = masked_mean(-log_ratio, response_mask)
    zero = torch.zeros(())
    return loss, _floats(pg_clipfrac=zero, ppo_kl=ppo_kl, pg_clipfrac_lower=zero)


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (arXiv:2504.02546): plain policy gradient `l = -A logp`, no ratio, no clipping; no metrics."""
    del old_log_prob
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return loss, {}


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = _D.clip_ratio,
    clip_ratio_low: float | None = _D.clip_ratio_low,
    clip_ratio_high: float | None = _D.clip_ratio_high,
    clip_cov_ratio: float = _D.clip_cov_ratio,
    clip_cov_lb: float = _D.clip_cov_lb,
    clip_cov_ub: float = _D.clip_cov_ub,
    generator: torch.Generator | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (arXiv:2505.22617): PPO clip, plus the gradient of a few high-covariance tokens cut.

    `cov_t = (A_t - mean(A)) * (logp_t - mean(logp))` (masked means). Among tokens not already
    clipped by PPO with `clip_cov_lb < cov_t < clip_cov_ub`, `max(1, int(clip_cov_ratio * #tokens))`
    are drawn at random (`generator`, else torch's global RNG) and their loss is multiplied by 0.
    `pg_clipfrac` reports the share of cut tokens.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    clip_by_origin = (pg_losses2 > pg_losses1) & valid

    with torch.no_grad():
        cov_all = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob.detach(), response_mask)
        )
        cov_all = cov_all.masked_fill(~valid | clip_by_origin, -torch.inf)
        clip_num = torch.floor(clip_cov_ratio * response_mask.sum()).clamp(min=1)  # a device tensor: no sync
        candidate = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & valid
        # a uniformly random subset of min(clip_num, #candidates) candidates: the first clip_num in random order
        draws = torch.rand(
            advantages.shape, generator=generator,
            device=generator.device if generator is not None else advantages.device,
        )
        order = _rank_in(torch.where(candidate, draws.to(advantages.device), torch.inf))
        corr = torch.where(candidate & (order < clip_num), 0.0, 1.0).to(advantages.dtype)

    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return loss, _floats(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    kl_cov_ratio: float = _D.kl_cov_ratio,
    ppo_kl_coef: float = _D.ppo_kl_coef,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (arXiv:2505.22617): unclipped `-A r`, plus `ppo_kl_coef * |logp - old_logp|` on the
    `max(1, int(kl_cov_ratio * #tokens))` valid tokens of largest covariance
    `(A - mean A)(logp - mean logp)` (means over valid tokens). `ppo_kl` reports the masked mean of
    `|logp - old_logp|`, as verl.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    ppo_kl_abs = masked_mean(abs_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = pg_losses1 + ppo_kl_coef * abs_kl

    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob.detach() - masked_mean(log_prob.detach(), response_mask)
        )
        k = torch.floor(valid.sum() * kl_cov_ratio).clamp(min=1)  # a device tensor: no sync
        selected = valid & (_rank_in(torch.where(valid, -cov, torch.inf)) < k)  # the k largest valid covariances
    pg_losses = _weighted(torch.where(selected, pg_losses_kl, pg_losses1), rollout_is_weights)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return loss, _floats(ppo_kl=ppo_kl_abs)


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = _D.clip_ratio,
    clip_ratio_low: float | None = _D.clip_ratio_low,
    clip_ratio_high: float | None = _D.clip_ratio_high,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, never the gradient.

    `l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp`, so every token keeps a gradient.
    `pg_clipfrac` is the share of tokens whose ratio was clipped.
    """
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = _weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return loss, _floats(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=torch.zeros(()))


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = _D.clip_ratio,
    clip_ratio_low: float | None = _D.clip_ratio_low,
    clip_ratio_high: float | None = _D.clip_ratio_high,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = _D.loss_scale_factor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (arXiv:2507.20673): geometric mean of token ratios, clipped per token in log space.

    Per token `d = logp - old_logp`, `d' = sign(A) * min(sign(A) d, sign(A) clip(d, -eps_low, eps_high))`;
    per sequence `R_i = exp(mean_t d')`, `A_i = mean_t A`, `l_i = -A_i R_i`; the loss is the mean over
    sequences (verl), or `sum_i l_i / global_batch_size * dp_size` when a global count or
    `dp_size > 1` is given. Rollout IS weights enter as their per-sequence geometric mean.
    `loss_agg_mode`, `batch_num_tokens` and `loss_scale_factor` are not used.
    """
    del loss_agg_mode, batch_num_tokens, loss_scale_factor  # GMPO's objective is a per-sequence mean
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)
    sgn = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sgn * torch.min(sgn * log_ratio, sgn * log_ratio_clamped)

    num_tokens = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (num_tokens + 1e-8))
    seq_adv = (advantages * response_mask).sum(dim=-1) / (num_tokens + 1e-8)
    pg_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1)
        pg_losses = pg_losses * torch.exp(log_w / (num_tokens + 1e-8))
    if global_batch_size is None and dp_size == 1:
        loss = torch.mean(pg_losses)
    elif global_batch_size is None:
        raise ValueError(f"geo_mean with dp_size={dp_size} needs the global `global_batch_size`")
    else:
        loss = pg_losses.sum() / global_batch_size * dp_size

    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return loss, _floats(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)
