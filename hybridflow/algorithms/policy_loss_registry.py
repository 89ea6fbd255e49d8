"""The policy-loss registry and dispatch by name.

`register_policy_loss` / `get_policy_loss_fn` mirror verl's functions on top of the shared
`Registry` (a taken name and an unknown name are errors). `compute_policy_loss_from_config` lets the
actor worker call the loss named by `actor.policy_loss.loss_mode` with exactly the hyper-parameters
that loss declares (from `PPOLossConfig`), so no config object reaches the math in `policy_losses.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridflow.algorithms.config import PolicyLossConfig, PPOLossConfig
from hybridflow.utils.registry import Registry

if TYPE_CHECKING:
    import torch

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossFn",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss_from_config",
    "check_policy_loss_result",
]

PolicyLossFn = Callable[..., tuple[Any, dict[str, float]]]
"""(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, **hyper-parameters) -> (loss, metrics)."""
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under a name; a taken name raises `ValueError`."""
    return POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered under a name; an unknown name raises `KeyError` listing the known ones."""
    return POLICY_LOSSES.get(name)


_GLOBAL_BATCH_ARGS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def compute_policy_loss_from_config(
    config: PPOLossConfig,
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
    """Call the loss named by `config.policy_loss.loss_mode` with the config fields its signature accepts.

    Args:
        config: the actor's loss hyper-parameters; `config.policy_loss.loss_mode` names the loss.
        old_log_prob, log_prob, advantages, response_mask: (bs, response_len).
        rollout_is_weights: optional (bs, response_len) per-token importance weights.
        dp_size, batch_num_tokens, global_batch_size: global-batch normalisation (see `agg_loss`).

    Returns:
        (loss, metrics) from the named loss.

    Raises:
        KeyError: unknown `loss_mode` (lists the known ones).
        ValueError: global-batch normalisation was requested but the loss cannot take it.
    """
    name = config.policy_loss.loss_mode
    fn = get_policy_loss_fn(name)
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fields = loss_hyperparameters(config)
    fields.update(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    kwargs = {k: v for k, v in fields.items() if takes_var_kw or k in params}
    requested = [k for k in _GLOBAL_BATCH_ARGS if fields[k] is not None and (k != "dp_size" or dp_size != 1)]
    dropped = [k for k in requested if k not in kwargs]
    if dropped:
        raise ValueError(
            f"policy loss {name!r} does not accept {dropped}, so it cannot normalise over the "
            "global batch; add these keyword arguments and pass them to agg_loss"
        )
    if rollout_is_weights is not None:
        kwargs["rollout_is_weights"] = rollout_is_weights
    result = fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=config.loss_agg_mode,
        **kwargs,
    )
    return check_policy_loss_result(name, result, log_prob)


def check_policy_loss_result(name: str, result: Any, log_prob: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """A loss's `(loss, metrics)`, or an error naming the loss and its contract: `loss` a 0-d tensor that carries
    the gradient of `log_prob` (aggregated with `agg_loss`), `metrics` a dict of numbers or 0-d tensors. Reads
    tensor metadata only: no device synchronisation."""
    import torch

    contract = (f"policy loss {name!r} must return (loss, metrics): loss a 0-d tensor aggregated with agg_loss "
                f"from log_prob, metrics a dict of numbers or 0-d tensors")
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"{contract}; it returned {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{contract}; its loss is {shape} (aggregate the per-token loss with agg_loss)")
    if log_prob.requires_grad and not loss.requires_grad:
        raise ValueError(f"{contract}; its loss carries no gradient (it must be computed from log_prob, not detached)")
    if not isinstance(metrics, dict):
        raise TypeError(f"{contract}; its metrics are {type(metrics).__name__}")
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.dim() != 0:
            raise ValueError(f"{contract}; its metric {key!r} has shape {tuple(value.shape)} (reduce it to one number)")
    return loss, metrics


_NOT_LOSS_ARGS = ("loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "policy_loss")


def loss_hyperparameters(config: PPOLossConfig) -> dict[str, object]:
    """The keyword hyper-parameters a policy loss may take: the clip/sapo fields of `PPOLossConfig` and the
    fields of its `policy_loss` section except the loss name (fields of subclasses, e.g. batch sizes, never)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(PPOLossConfig) if f.name not in _NOT_LOSS_ARGS}
    values.update(
        (f.name, getattr(config.policy_loss, f.name)) for f in dataclasses.fields(PolicyLossConfig) if f.name != "loss_mode"
    )
    return values


# The built-in losses register lazily: `policy_losses` (torch) loads on the first `get`, so the config checks
# before Ray read the names without torch.
for _name in ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "cispo", "geo_mean"):
    POLICY_LOSSES.register_lazy(_name, f"hybridflow.algorithms.policy_losses:compute_policy_loss_{_name}")
