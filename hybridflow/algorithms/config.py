"""Hyper-parameters of the algorithms: policy losses, the actor's loss terms, advantage estimation, KL control.

Field names are verl's keys. `PPOLossConfig` holds what verl puts directly under `actor_rollout_ref.actor`
(clip ratios, loss aggregation, entropy and KL-loss terms); the actor's config extends it with batch sizes and
the optimizer, so each setting is defined once, here, and the losses read it by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hybridflow.algorithms.kl import KL_PENALTY_TYPES
from hybridflow.algorithms.loss_agg import LossAggMode
from hybridflow.utils.config import (
    ConfigFieldError,
    check_at_least,
    check_choice,
    check_literal_fields,
    check_positive,
    check_range,
    unsupported,
)

__all__ = [
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "PPOLossConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
]


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Which registered policy loss runs, and the hyper-parameters only some losses take (`actor.policy_loss.*`)."""

    loss_mode: str = "vanilla"
    """A registered policy loss: vanilla | gspo | gpg | clip_cov | kl_cov | sapo | cispo | geo_mean | ..."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower covariance bound of the candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound of the candidates."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log-ratio| penalty."""

    def __post_init__(self) -> None:
        check_range("clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0)
        check_range("kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0)
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ConfigFieldError(
                "clip_cov_lb", f"clip_cov_lb={self.clip_cov_lb} is above clip_cov_ub={self.clip_cov_ub}; swap them"
            )


@dataclass(frozen=True, kw_only=True)
class PPOLossConfig:
    """The actor's loss: clipped policy loss, its aggregation, entropy bonus and KL loss (`actor.*`)."""

    clip_ratio: float = 0.2
    """PPO clip epsilon, used for both sides unless clip_ratio_low/high are set."""
    clip_ratio_low: Optional[float] = None
    """Lower clip epsilon; None uses clip_ratio."""
    clip_ratio_high: Optional[float] = None
    """Upper clip epsilon (DAPO clip-higher, e.g. 0.28); None uses clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are reduced over the mini-batch."""
    loss_scale_factor: Optional[float] = None
    """Divisor of seq-mean-token-sum-norm; None uses the response length (Dr. GRPO)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (0 turns it off and skips computing entropy in the update)."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style); needs reference log-probs."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: kl | abs | mse | low_var_kl | k1 | k2 | k3, and '+' variants (straight-through)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss, and its own hyper-parameters."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("clip_ratio", self.clip_ratio)
        for name in ("clip_ratio_low", "clip_ratio_high"):
            check_positive(name, getattr(self, name), allow_none=True)
        if self.clip_ratio_c <= 1.0:
            raise ConfigFieldError(
                "clip_ratio_c", f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip PPO bounds the loss at c*|A|)"
            )
        check_positive("tau_pos", self.tau_pos)
        check_positive("tau_neg", self.tau_neg)
        check_positive("loss_scale_factor", self.loss_scale_factor, allow_none=True)
        check_at_least("kl_loss_coef", self.kl_loss_coef, 0.0)
        check_choice("kl_loss_type", self.kl_loss_type, KL_PENALTY_TYPES)


@dataclass(frozen=True, kw_only=True)
class KLControlConfig:
    """Coefficient of the KL-in-reward penalty (`algorithm.kl_ctrl.*`)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed keeps kl_coef; adaptive moves it toward target_kl."""
    kl_coef: float = 0.001
    """Initial coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon in samples."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("kl_coef", self.kl_coef, 0.0)
        check_positive("horizon", self.horizon)
        check_positive("target_kl", self.target_kl)


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO dynamic sampling (`algorithm.filter_groups.*`)."""

    enable: bool = unsupported(False, "DAPO dynamic sampling (regenerating until groups disagree) is not in the trainer")
    """Drop prompt groups whose rewards all agree and generate more until the batch is full."""
    metric: str = "acc"
    """Per-sample metric compared within a group."""
    max_num_gen_batches: int = 0
    """Most generation batches per step (0: no limit)."""


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout's and the trainer's log-probs (`algorithm.rollout_correction.*`)."""

    bypass_mode: bool = False
    """Use the rollout engine's own log-probs as the old log-probs and skip the trainer's old-log-prob pass; only for
    engines whose log-probs match the training engine's (native)."""
    loss_type: Literal["ppo_clip"] = "ppo_clip"
    """Loss in bypass mode: the PPO clipped objective."""
    rollout_is: Optional[str] = unsupported(None, "importance weights between rollout and trainer are not computed yet")
    """Importance-sampling aggregation level: token | sequence."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights (with rollout_is)."""
    rollout_rs: Optional[str] = unsupported(None, "rejection sampling of off-policy tokens is not implemented yet")
    """Rejection-sampling rule."""
    rollout_rs_threshold: Optional[float] = None
    """Threshold of the rejection-sampling rule (with rollout_rs)."""
    rollout_is_batch_normalize: bool = unsupported(False, "importance weights are not computed yet")
    """Normalise the importance weights to mean 1 over the batch."""

    def __post_init__(self) -> None:
        check_literal_fields(self)


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and reward shaping (`algorithm.*`)."""

    adv_estimator: str = "gae"
    """A registered estimator: gae | grpo | grpo_passk | rloo | opo | reinforce_plus_plus | gpg | ..."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std; False gives Dr. GRPO."""
    use_kl_in_reward: bool = False
    """Subtract a KL(actor || ref) penalty from token rewards; needs reference log-probs."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Penalty coefficient controller."""
    use_pf_ppo: bool = unsupported(False, "preference-feedback PPO reweighting is not implemented")
    """Reweight samples by reward before the update (PF-PPO)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Where the old log-probs come from, and off-policy correction."""

    def __post_init__(self) -> None:
        check_range("gamma", self.gamma, 0.0, 1.0)
        check_range("lam", self.lam, 0.0, 1.0)
        check_choice("kl_penalty", self.kl_penalty, KL_PENALTY_TYPES)
