"""Rollout correction: importance weights and rejection between the rollout engine's and the trainer's log-probs.

Owns the math of verl's `algorithm.rollout_correction.*` (decoupled mode): the per-token log-ratio
`log rho_t = old_log_prob_t - rollout_log_prob_t` (trainer over rollout policy), truncated importance
sampling (TIS) weights at token or sequence level, rejection ("masked importance sampling") of tokens or
whole sequences whose divergence lies beyond thresholds, and the `rollout_corr/*` diagnostics verl logs.

Rejection rules (`rollout_rs`, several joined by commas, all must pass) are `<level>_<estimator>`:
estimators of each token's divergence `k1 = -log rho`, `k2 = (log rho)^2 / 2`, `k3 = rho - 1 - log rho`;
levels `token` (each token on its own), `seq_sum`, `seq_mean` (`seq_mean_k1` is the geometric-mean ratio,
"Geo-RS") and `seq_max` (a sequence is kept or dropped whole). k1 rules take a lower and an upper bound
given as ratios (`"0.5_2.0"`, a single number u means `1/u_u`) and keep `log(lower) <= k1 <= log(upper)`
as verl does, i.e. ratios in [1/upper, 1/lower] (the same interval for symmetric bounds); k2/k3 rules take an
upper bound only.

Numbers follow verl's `rollout_corr_helper` (log-ratios clamped to +-20 before exponentiating, metrics of
the weights before truncation), except that per-sequence statistics skip sequences without a valid token.
Pure torch: the driver holds the whole batch, so batch normalisation needs no collective.

Reference: Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch" (https://richardli.xyz/rl-collapse).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.algorithms.rejection_rules import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    RejectionRule,
    build_rejection_rules,
    parse_rollout_rs,
)

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "SAFETY_BOUND",
    "RejectionRule",
    "build_rejection_rules",
    "compute_offpolicy_metrics",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_log_ratio",
    "compute_rollout_rejection_mask",
    "parse_rollout_rs",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before `exp` (weights within about [2e-9, 5e8])."""


def compute_rollout_log_ratio(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """old_log_probs, rollout_log_probs, response_mask: (bs, response_len) -> (bs, response_len) float32
    `log(pi_old / pi_rollout)` at valid tokens, 0 elsewhere (padding cannot leak NaN or inf)."""
    if not old_log_probs.shape == rollout_log_probs.shape == response_mask.shape:
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have one shape"
        )
    diff = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    return torch.where(response_mask.bool(), diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def _check_has_tokens(response_mask: torch.Tensor) -> None:
    if not response_mask.bool().any():
        raise ValueError("rollout correction needs at least one valid token in response_mask; the batch has none")


def _safe_exp(log_values: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_values.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Population std over the mask (verl's E[x^2] - E[x]^2, clamped at 0); 0 for fewer than 2 positions."""
    if mask.sum() <= 1:
        return 0.0
    mean = masked_mean(values, mask)
    return float(torch.sqrt(torch.clamp(masked_mean(values.square(), mask) - mean.square(), min=0.0)))


def _sequence_summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """`{prefix}_seq_{mean,std,max,min}` of per-sequence values (bs_valid,); zeros for an empty batch."""
    if values.numel() == 0:
        return {f"{prefix}_seq_{name}": 0.0 for name in ("mean", "std", "max", "min")}
    return {
        f"{prefix}_seq_mean": float(values.mean()),
        f"{prefix}_seq_std": float(values.std()) if values.numel() > 1 else 0.0,
        f"{prefix}_seq_max": float(values.max()),
        f"{prefix}_seq_min": float(values.min()),
    }


# ----------------------------------------------------------------------------- importance weights (TIS)
def compute_rollout_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights `min(rho, threshold)`, detached, 0 at padding.

    Args:
        log_ratio: (bs, response_len) `log(pi_old / pi_rollout)` (see `compute_rollout_log_ratio`).
        response_mask: (bs, response_len) 1 for valid tokens.
        rollout_is: `token` (rho_t per token) or `sequence` (`exp(sum_t log rho_t)` on every token of the row).
        rollout_is_threshold: upper truncation of the weights (> 0).
        rollout_is_batch_normalize: divide by the batch mean of the truncated weights (over tokens for
            `token`, over sequences for `sequence`) so they average 1.

    Returns:
        (weights (bs, response_len) float32, metrics `rollout_is_*` without the `rollout_corr/` prefix); the
        metrics describe the weights before truncation, as verl's do.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not one of {list(ROLLOUT_IS_LEVELS)}")
    if not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold={rollout_is_threshold!r} must be > 0")
    _check_has_tokens(response_mask)
    mask = response_mask.to(log_ratio.dtype)
    seq_valid = response_mask.bool().any(-1)
    raw, seq_log_ratio = _raw_weights(log_ratio, mask, rollout_is)
    metrics = _is_metrics(raw, seq_log_ratio[seq_valid], mask, rollout_is, rollout_is_threshold)
    weights = raw.clamp(max=rollout_is_threshold).detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            batch_mean = masked_mean(weights, mask)
        else:
            batch_mean = masked_mean(weights, mask, axis=-1)[seq_valid].mean()
        factor = float(batch_mean) if batch_mean > 1e-8 else 1.0
        metrics["rollout_is_batch_norm_factor"] = factor
        weights = weights / factor
    return weights, metrics


def _raw_weights(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_is: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(untruncated weights (bs, L), 0 at padding; each row's summed log ratio (bs,)) at `rollout_is`'s level."""
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1)
    log_weights = log_ratio if rollout_is == "token" else seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)
    zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
    return torch.where(mask.bool(), _safe_exp(log_weights), zero), seq_log_ratio


def _is_metrics(
    raw: torch.Tensor, seq_log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
) -> dict[str, float]:
    """verl's `rollout_is_*` metrics of untruncated weights raw (bs, L); seq_log_ratio (bs_valid,)."""
    lower = 1.0 / threshold
    valid = mask.bool()
    metrics = {"rollout_is_mean": float(masked_mean(raw, mask))}
    if level == "sequence":
        # In log space: a sequence weight can be far beyond what the float range (or the safety bound) holds.
        metrics["rollout_is_max"] = math.exp(min(float(seq_log_ratio.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(float(seq_log_ratio.min()))
        metrics["rollout_is_ratio_fraction_high"] = float((seq_log_ratio > math.log(threshold)).float().mean())
        metrics["rollout_is_ratio_fraction_low"] = float((seq_log_ratio < math.log(lower)).float().mean())
    else:
        metrics["rollout_is_max"] = float(raw[valid].max())
        metrics["rollout_is_min"] = float(raw[valid].min())
        metrics["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > threshold).float(), mask))
        metrics["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lower).float(), mask))
    bounded = raw.clamp(min=lower, max=threshold)
    metrics["rollout_is_std"] = _masked_std(bounded, mask)
    # Effective sample size as a fraction of the tokens: 1 / E[(w / E[w])^2] of the bounded weights.
    normalized = bounded / (masked_mean(bounded, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalized.square(), mask))
    seq_weights = masked_mean(raw, mask, axis=-1)[valid.any(-1)]
    metrics.update(_sequence_summary("rollout_is", seq_weights))
    metrics["rollout_is_seq_max_deviation"] = float((seq_weights - 1.0).abs().max())
    metrics["rollout_is_seq_fraction_high"] = float((seq_weights > threshold).float().mean())
    metrics["rollout_is_seq_fraction_low"] = float((seq_weights < lower).float().mean())
    return metrics


# ----------------------------------------------------------------------------- rejection (MIS / RS)
def _token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """(bs, L) log rho -> (bs, L) k1 = -log rho, k2 = (log rho)^2 / 2 or k3 = rho - 1 - log rho."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -safe
    if estimator == "k2":
        return 0.5 * safe.square()
    return torch.expm1(safe) - safe


def _sequence_statistic(values: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """(bs, L) -> (bs,) masked sum, mean or max over each row (a row without valid tokens gives 0)."""
    if aggregation == "sum":
        return masked_sum(values, mask, axis=-1)
    if aggregation == "mean":
        return masked_mean(values, mask, axis=-1)
    largest = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(largest) & (largest < 0), torch.zeros_like(largest), largest)


def _within(values: torch.Tensor, rule: RejectionRule) -> torch.Tensor:
    keep = values <= rule.upper  # NaN compares False: a NaN statistic is rejected
    return keep & (values >= rule.lower) if rule.lower is not None else keep


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_rs: str,
    rollout_rs_threshold: str | float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`response_mask` with the tokens (token rules) or whole sequences (seq rules) that fail a rule set to 0.

    Args:
        log_ratio: (bs, response_len) `log(pi_old / pi_rollout)`.
        response_mask: (bs, response_len) 1 for valid tokens.
        rollout_rs: comma-separated `ROLLOUT_RS_OPTIONS`; a token is kept only if every rule keeps it.
        rollout_rs_threshold: bounds, see `build_rejection_rules`.

    Returns:
        (mask (bs, response_len) of response_mask's dtype, metrics `rollout_rs_*` without the prefix):
        per rule verl's statistic summary and `rollout_rs_{rule}_masked_fraction` (of valid tokens),
        `..._seq_masked_fraction` (of non-empty sequences); overall `rollout_rs_masked_fraction` and
        `rollout_rs_seq_masked_fraction`.
    """
    rules = build_rejection_rules(rollout_rs, rollout_rs_threshold)
    _check_has_tokens(response_mask)
    valid = response_mask.bool()
    mask = response_mask.to(log_ratio.dtype)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for rule in rules:
        rule_keep, token_stat, seq_stat = _rule_keep(log_ratio, mask, rule)
        metrics.update(_rejection_metrics(rule, token_stat, seq_stat, mask))
        metrics.update(_masked_fractions(f"rollout_rs_{rule.option}", rule_keep, valid))
        keep = keep & rule_keep
    metrics.update(_masked_fractions("rollout_rs", keep, valid))
    return (response_mask * keep.to(response_mask.dtype)).to(response_mask.dtype), metrics


def _rule_keep(
    log_ratio: torch.Tensor, mask: torch.Tensor, rule: RejectionRule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens the rule keeps (bs, L) bool, its statistic per token (bs, L) and per sequence (bs,))."""
    divergence = _token_divergence(log_ratio, rule.estimator)
    if rule.aggregation == "token":
        return _within(divergence, rule), divergence, masked_mean(divergence, mask, axis=-1)
    seq_stat = _sequence_statistic(divergence, mask, rule.aggregation)
    per_token = seq_stat.unsqueeze(-1).expand_as(log_ratio)
    return _within(seq_stat, rule).unsqueeze(-1).expand_as(log_ratio), per_token, seq_stat


def _masked_fractions(prefix: str, keep: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    dropped = ~keep & valid
    seq_valid = valid.any(-1)
    return {
        f"{prefix}_masked_fraction": float(dropped.sum() / valid.sum().clamp(min=1)),
        f"{prefix}_seq_masked_fraction": float(dropped.any(-1)[seq_valid].float().mean()) if seq_valid.any() else 0.0,
    }


def _rejection_metrics(
    rule: RejectionRule, token_stat: torch.Tensor, seq_stat: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's `rollout_rs_{rule}_*` summary of a rule's statistic: token_stat (bs, L), seq_stat (bs,)."""
    prefix = f"rollout_rs_{rule.option}"
    valid = mask.bool()
    seq_values = seq_stat[valid.any(-1)]
    per_token = rule.aggregation == "token"
    population = token_stat[valid] if per_token else seq_values  # what max/min/fractions are taken over
    metrics = {
        f"{prefix}_mean": float(masked_mean(token_stat, mask)),
        f"{prefix}_max": float(population.max()),
        f"{prefix}_min": float(population.min()),
        f"{prefix}_fraction_high": float((population > rule.upper).float().mean()),
        f"{prefix}_fraction_low": float((population < rule.lower).float().mean()) if rule.lower is not None else 0.0,
        f"{prefix}_std": _masked_std(
            token_stat.clamp(min=rule.lower if rule.lower is not None else 0.0, max=rule.upper), mask
        ),
    }
    metrics.update(_sequence_summary(prefix, seq_values))
    metrics[f"{prefix}_seq_max_deviation"] = float(seq_values.abs().max()) if seq_values.numel() else 0.0
    metrics[f"{prefix}_seq_fraction_high"] = float((seq_values > rule.upper).float().mean())
    if rule.lower is not None:
        metrics[f"{prefix}_seq_fraction_low"] = float((seq_values < rule.lower).float().mean())
    return metrics


# ----------------------------------------------------------------------------- diagnostics and the pipeline
def compute_offpolicy_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics (without the prefix) between trainer and rollout log-probs, (bs, L) each.

    `kl` = E_tokens[rollout - old] (KL(rollout || trainer), k1), `k3_kl` = E[rho - 1 - log rho];
    `{training,rollout}_ppl` = mean over sequences of exp(-mean token log-prob), `*_log_ppl` without the exp;
    `log_ppl_diff` = mean over sequences of (rollout - trainer mean log-prob) (also `_abs_diff`, `_max`, `_min`),
    `ppl_ratio` = mean of exp(log_ppl_diff); `chi2_token` = E_tokens[rho^2] - 1, `chi2_seq` = E_seq[prod rho^2] - 1.
    """
    _check_has_tokens(response_mask)
    mask = response_mask.float()
    seq_valid = response_mask.bool().any(-1)
    log_ratio = compute_rollout_log_ratio(old_log_probs, rollout_log_probs, response_mask)
    train_mean = masked_mean(old_log_probs.detach().float(), mask, axis=-1)[seq_valid]
    rollout_mean = masked_mean(rollout_log_probs.detach().float(), mask, axis=-1)[seq_valid]
    log_ppl_diff = rollout_mean - train_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1)[seq_valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-train_mean).mean()),
        "training_log_ppl": float((-train_mean).mean()),
        "kl": float(masked_mean(-log_ratio, mask)),
        "k3_kl": float(masked_mean(torch.expm1(safe) - safe, mask)),
        "rollout_ppl": float(torch.exp(-rollout_mean).mean()),
        "rollout_log_ppl": float((-rollout_mean).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(2.0 * safe), mask)) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean()) - 1.0,
    }


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """Importance weights, rejection mask and diagnostics in one pass (verl's decoupled mode).

    Args:
        old_log_probs: (bs, response_len) the trainer's log-probs of the sampled tokens.
        rollout_log_probs: (bs, response_len) the rollout engine's log-probs of the same tokens.
        response_mask: (bs, response_len) 1 for valid tokens; needs at least one.
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize: see `compute_rollout_is_weights`
            (None: no weights).
        rollout_rs, rollout_rs_threshold: see `compute_rollout_rejection_mask` (None: nothing rejected).

    Returns:
        (weights (bs, response_len) or None, mask (bs, response_len), metrics under `rollout_corr/`). Weights
        and metrics use the original mask; rejection only changes the returned mask.
    """
    _check_has_tokens(response_mask)
    log_ratio = compute_rollout_log_ratio(old_log_probs, rollout_log_probs, response_mask)
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(
            log_ratio, response_mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_probs, rollout_log_probs, response_mask))
    return weights, mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}


# ----------------------------------------------------------------------------- bypass mode (inside the loss)
def compute_bypass_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """verl's bypass-mode correction, per micro-batch inside the actor's loss: the current policy against the
    rollout's (the old policy there). Nothing is read back to the host: the metrics are 0-dim device tensors.

    Args:
        log_probs: (bs, response_len) the current policy's log-probs (detached here).
        rollout_log_probs: (bs, response_len) the rollout engine's.
        response_mask: (bs, response_len) 1 for valid tokens.
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize: truncated weights pi_current / pi_rollout per
            token or per sequence (None: none), divided by their micro-batch mean when asked.
        rollout_rs, rollout_rs_threshold: rejection rules as in `compute_rollout_rejection_mask`.

    Returns:
        (weights (bs, response_len) or None, the mask with rejected tokens at 0, metrics under `rollout_corr/`).
    """
    log_ratio = compute_rollout_log_ratio(log_probs, rollout_log_probs, response_mask)
    mask = response_mask.to(log_ratio.dtype)
    valid = response_mask.bool()
    metrics = {"rollout_corr/bypass_kl": masked_mean(-log_ratio, mask)}
    weights = None
    if rollout_is is not None:
        raw, _ = _raw_weights(log_ratio, mask, rollout_is)
        weights = raw.clamp(max=rollout_is_threshold)
        if rollout_is_batch_normalize:
            mean = masked_mean(weights, mask)
            weights = weights / torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        metrics["rollout_corr/rollout_is_mean"] = masked_mean(raw, mask)
        truncated = (raw > rollout_is_threshold).to(mask.dtype)
        metrics["rollout_corr/rollout_is_truncated_fraction"] = masked_mean(truncated, mask)
    keep = torch.ones_like(valid)
    for rule in build_rejection_rules(rollout_rs, rollout_rs_threshold) if rollout_rs is not None else ():
        keep = keep & _rule_keep(log_ratio, mask, rule)[0]
    if rollout_rs is not None:
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean((~keep & valid).to(mask.dtype), mask)
    return weights, response_mask * keep.to(response_mask.dtype), metrics
