"""The policy-loss registry, the `PolicyLossConfig` dataclass and dispatch by name.

`register_policy_loss` / `get_policy_loss_fn` mirror verl's functions on top of the shared
`Registry` (a taken name and an unknown name are errors). `compute_policy_loss_from_config` lets the
actor worker call the loss named by `actor.policy_loss.loss_mode` with exactly the hyper-parameters
that loss declares, so no config object reaches the math in `policy_losses.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

from hybridflow.utils.registry import Registry

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss_from_config",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Hyper-parameters of the policy losses; field names are verl's actor/policy_loss keys."""

    loss_mode: str = "vanilla"
    """Registered loss name (`actor.policy_loss.loss_mode`)."""
    loss_agg_mode: str = "token-mean"
    """How the per-token loss is reduced (`actor.loss_agg_mode`); see `agg_loss`."""
    clip_ratio: float = 0.2
    """PPO clip epsilon, used for both sides unless overridden (`actor.clip_ratio`)."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon; None = clip_ratio (`actor.clip_ratio_low`)."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher, e.g. 0.28); None = clip_ratio (`actor.clip_ratio_high`)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (`actor.clip_ratio_c`)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is cut (`actor.policy_loss.clip_cov_ratio`)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower covariance bound for candidates (`actor.policy_loss.clip_cov_lb`)."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound for candidates (`actor.policy_loss.clip_cov_ub`)."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens that get the KL penalty (`actor.policy_loss.kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log-ratio| penalty (`actor.policy_loss.ppo_kl_coef`)."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages (`actor.tau_pos`)."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages (`actor.tau_neg`)."""
    loss_scale_factor: float | None = None
    """Divisor of `seq-mean-token-sum-norm`; None = response length (`actor.loss_scale_factor`)."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1.0 (dual-clip PPO), got {self.clip_ratio_c}")
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"actor.{name} must be >= 0, got {value}")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under a name; a taken name raises `ValueError`."""
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered under a name; an unknown name raises `KeyError` listing the known ones."""
    return POLICY_LOSSES.get(name)


_GLOBAL_BATCH_ARGS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def compute_policy_loss_from_config(
    config: PolicyLossConfig,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Call the loss named by `config.loss_mode` with the config fields its signature accepts.

    Args:
        config: hyper-parameters and the loss name.
        old_log_prob, log_prob, advantages, response_mask: (bs, response_len).
        rollout_is_weights: optional (bs, response_len) per-token importance weights.
        dp_size, batch_num_tokens, global_batch_size: global-batch normalisation (see `agg_loss`).

    Returns:
        (loss, metrics) from the named loss.

    Raises:
        KeyError: unknown `loss_mode` (lists the known ones).
        ValueError: global-batch normalisation was requested but the loss cannot take it.
    """
    fn = get_policy_loss_fn(config.loss_mode)
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields.update(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    fields.pop("loss_mode")
    fields.pop("loss_agg_mode")
    kwargs = {k: v for k, v in fields.items() if takes_var_kw or k in params}
    requested = [k for k in _GLOBAL_BATCH_ARGS if fields[k] is not None and (k != "dp_size" or dp_size != 1)]
    dropped = [k for k in requested if k not in kwargs]
    if dropped:
        raise ValueError(
            f"policy loss {config.loss_mode!r} does not accept {dropped}, so it cannot normalise over the "
            "global batch; add these keyword arguments and pass them to agg_loss"
        )
    if rollout_is_weights is not None:
        kwargs["rollout_is_weights"] = rollout_is_weights
    return fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=config.loss_agg_mode,
        **kwargs,
    )
