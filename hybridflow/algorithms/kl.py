"""KL penalties between the policy and the reference model, the KL coefficient controllers, and
KL-in-reward (`algorithm.use_kl_in_reward=True`).

Estimators (J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html),
with `d = logprob - ref_logprob`:

- `kl` / `k1`: `d`
- `abs`: `|d|`
- `mse` / `k2`: `d^2 / 2`
- `low_var_kl` / `k3`: `exp(-d) + d - 1`, with `-d` clamped to [-20, 20] and the result to [-10, 10]
- `<name>+` (e.g. `k1+`, `k3+`, `low_var_kl+`): the value of `<name>` with the gradient of `k2`
  (straight-through: `k2 - sg[k2] + sg[<name>]`). k1 and k3 estimate the KL value without bias but not
  its gradient; k2's gradient is the right one.

Used as a loss term with `actor_rollout_ref.actor.use_kl_loss=True, kl_loss_type=<name>`, or as a
reward penalty with `algorithm.use_kl_in_reward=True, algorithm.kl_penalty=<name>`.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import torch

from hybridflow.algorithms.config import KL_PENALTY_TYPES
from hybridflow.algorithms.masked import masked_mean

__all__ = [
    "KL_PENALTY_TYPES",
    "kl_penalty",
    "kl_penalty_forward",
    "compute_rewards",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "build_kl_controller",
    "get_kl_controller",
    "apply_kl_penalty",
]



def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The plain estimator named `kl_penalty` (no `+`), element-wise.

    Args:
        logprob: (bs, response_len) log-probs of the sampled tokens under the policy.
        ref_logprob: (bs, response_len) the same under the reference model.
        kl_penalty: one of `kl`, `k1`, `abs`, `mse`, `k2`, `low_var_kl`, `k3`.

    Returns:
        (bs, response_len), unmasked.

    Raises:
        ValueError: unknown name (verl raises NotImplementedError).
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # clamp before exp for stability
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; known: {list(KL_PENALTY_TYPES)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate `kl_penalty` (see the module docstring for the names), element-wise.

    Args:
        logprob: (bs, response_len) policy log-probs (carries the gradient when used as a loss).
        ref_logprob: (bs, response_len) reference log-probs.
        kl_penalty: estimator name; a trailing `+` keeps the value and takes k2's gradient.

    Returns:
        (bs, response_len), unmasked; reduce it with `agg_loss`.
    """
    if not kl_penalty.endswith("+"):
        return kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    forward = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
    if kl_penalty in ("mse+", "k2+"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


_kl_penalty = kl_penalty  # reachable inside `apply_kl_penalty`, whose argument shadows the name


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """`scores - kl_ratio * (old_log_prob - ref_log_prob)`, all (bs, response_len) (verl's helper)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


class KLController(Protocol):
    """A KL coefficient holder: `value` is the current coefficient, `update` adapts it after a step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant KL coefficient (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; the coefficient stays `kl_coef`."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), `algorithm.kl_ctrl.type=adaptive`.

    After each step: `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`,
    `value *= 1 + e * n_steps / horizon`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward keeping `current_kl` at `target_kl`; `n_steps` = samples this step."""
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


def build_kl_controller(
    type: Literal["fixed", "adaptive"] = "fixed",  # noqa: A002 - verl's key name
    kl_coef: float = 0.001,
    target_kl: float = 0.1,
    horizon: int = 10000,
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `algorithm.kl_ctrl.type` from its fields (defaults are verl's)."""
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got {type!r}")


def get_kl_controller(kl_ctrl: object) -> FixedKLController | AdaptiveKLController:
    """verl-compatible factory: read `type`, `kl_coef`, `target_kl`, `horizon` from a config-like object."""
    kind = kl_ctrl.type  # type: ignore[attr-defined]
    if kind == "fixed":
        return build_kl_controller("fixed", kl_coef=kl_ctrl.kl_coef)  # type: ignore[attr-defined]
    return build_kl_controller(
        kind,
        kl_coef=kl_ctrl.kl_coef,  # type: ignore[attr-defined]
        target_kl=kl_ctrl.target_kl,  # type: ignore[attr-defined]
        horizon=kl_ctrl.horizon,  # type: ignore[attr-defined]
    )


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward: `rewards = scores - beta * KL_t * mask`, then adapt the controller (as verl).

    `beta` is `kl_ctrl.value` before the update. The step's KL is the batch mean of per-sequence
    masked means of the penalty; `kl_ctrl.update(current_kl, n_steps=bs)` is called with it, so the
    controller (the only state involved) changes in place.

    Args:
        token_level_scores: (bs, response_len) reward-model / rule scores.
        old_log_prob: (bs, response_len) policy log-probs of the rollout.
        ref_log_prob: (bs, response_len) reference log-probs.
        response_mask: (bs, response_len).
        kl_ctrl: fixed or adaptive controller; updated in place.
        kl_penalty: estimator name (`algorithm.kl_penalty`).

    Returns:
        token_level_rewards (bs, response_len), and metrics
        `{"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}` (floats).
    """
    kld = _kl_penalty(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(torch.mean(masked_mean(kld, response_mask, axis=-1), dim=0).item())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
