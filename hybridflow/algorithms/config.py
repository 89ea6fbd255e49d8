"""Hyper-parameters of the algorithms: policy losses, the actor's loss terms, advantage estimation, KL control.

Field names are verl's keys. `PPOLossConfig` holds what verl puts directly under `actor_rollout_ref.actor`
(clip ratios, loss aggregation, entropy and KL-loss terms); the actor's config extends it with batch sizes and
the optimizer, so each setting is defined once, here, and the losses read it by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from hybridflow.algorithms.rejection_rules import ROLLOUT_IS_LEVELS, build_rejection_rules, parse_rollout_rs
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
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "LossAggMode",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "PPOLossConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
]


_BASE_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_TYPES: tuple[str, ...] = _BASE_KL_TYPES + tuple(f"{name}+" for name in _BASE_KL_TYPES)
"""KL estimators (`kl.kl_penalty`); a `+` suffix takes the k3 value with the k2 gradient (straight-through)."""
LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
"""Loss aggregations (`loss_agg.agg_loss`)."""


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

    enable: bool = False
    """Drop prompt groups whose samples all agree on `metric` and generate more until data.train_batch_size groups
    are in (generation batches hold data.gen_batch_size prompts)."""
    metric: str = "acc"
    """Per-sample value compared within a group: seq_reward / seq_final_reward (the summed reward), or a column the
    reward manager returns (acc, score, or a key the scorer returns)."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before the run stops with an error (0: no limit)."""

    def __post_init__(self) -> None:
        check_at_least("max_num_gen_batches", self.max_num_gen_batches, 0, "0 means no limit")
        if not self.metric:
            raise ConfigFieldError("metric", "metric is empty; use acc, score, seq_reward or seq_final_reward")


PFPPOReweightMethod = Literal["pow", "max_min", "max_random"]


@dataclass(frozen=True, kw_only=True)
class PFPPOConfig:
    """PF-PPO's policy filtration (`algorithm.pf_ppo.*`, with `algorithm.use_pf_ppo`): after GAE, the batch is
    resampled with replacement, each sample weighted by its summed reward score, so the update sees mostly the
    samples whose reward is most reliable (`hybridflow.algorithms.pf_ppo`)."""

    reweight_method: PFPPOReweightMethod = "pow"
    """pow: |score|^weight_pow; max_min: only the batch's highest and lowest scores; max_random: the highest scores
    weigh 0.4, the others 0.1."""
    weight_pow: float = 2.0
    """The power of the pow method."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("weight_pow", self.weight_pow, 0.0)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout's and the trainer's log-probs (`algorithm.rollout_correction.*`).

    With `rollout_is` or `rollout_rs` set, the driver compares the trainer's old log-probs with the rollout
    engine's (`rollout_log_probs`) after the old-log-prob pass: importance weights multiply each token's policy
    loss, rejected tokens leave `response_mask` (so the advantages, losses and their token counts skip them).
    Math and metric names (`rollout_corr/*`): `hybridflow.algorithms.rollout_correction`.
    """

    bypass_mode: bool = False
    """Use the rollout engine's own log-probs as the old log-probs and skip the trainer's old-log-prob pass (two
    policies: rollout and current); only for engines whose log-probs match the training engine's (native). The
    corrections then compare the current policy with the rollout inside the loss, per micro-batch, as verl's bypass
    loss does: rollout_rs rejects tokens there, and rollout_is weights the REINFORCE loss (loss_type=reinforce);
    with ppo_clip the clipped ratio is the correction and the weights are only measured."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Loss in bypass mode: ppo_clip (the PPO clipped objective with the rollout as the old policy) or reinforce
    (-A * w * log pi, w the truncated pi_current / pi_rollout of rollout_is, detached: the importance-sampled policy
    gradient)."""
    rollout_is: Optional[Literal["token", "sequence"]] = None
    """Truncated importance sampling: token (weight pi_old/pi_rollout per token) | sequence (the product over the
    response, on each of its tokens) | null (no weights)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights (typical: 1.5-5 per token, 2-10 per sequence)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (over tokens, or over sequences), so they average 1."""
    rollout_rs: Optional[str] = None
    """Rejection of off-policy tokens or sequences: comma-separated rules, all must pass: token_k1|k2|k3,
    seq_sum_k1|k2|k3, seq_mean_k1|k2|k3 (seq_mean_k1: geometric-mean ratio), seq_max_k2|k3; k1 = -log ratio,
    k2 = (log ratio)^2/2, k3 = ratio - 1 - log ratio. Quote a list on the command line: 'token_k1,seq_max_k2'."""
    rollout_rs_threshold: Optional[str | float] = None
    """Bounds of rollout_rs, one entry for all rules or one per rule (comma-separated): k1 rules take ratios
    lower_upper (0.5_2.0; write the decimal points, Hydra reads 0.5_2 as 0.52) or one number u for 1/u_u and keep
    log(lower) <= -log ratio <= log(upper) as verl does; k2/k3 rules take one upper bound."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.rollout_is is not None:
            check_choice("rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        check_positive("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ConfigFieldError(
                "rollout_is_batch_normalize",
                "rollout_is_batch_normalize=True normalises importance weights, but rollout_is is null; "
                "set rollout_is=token or sequence, or rollout_is_batch_normalize=False",
            )
        self._check_rejection()
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ConfigFieldError(
                "loss_type",
                "loss_type='reinforce' is bypass mode's loss (the rollout as the old policy); set bypass_mode=True, "
                "or loss_type=ppo_clip",
            )

    @property
    def math_kwargs(self) -> dict:
        """The weight and rejection settings, as `compute_rollout_correction` and `compute_bypass_correction` take
        them."""
        return {
            "rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold,
            "rollout_is_batch_normalize": self.rollout_is_batch_normalize, "rollout_rs": self.rollout_rs,
            "rollout_rs_threshold": self.rollout_rs_threshold,
        }

    @property
    def in_loss(self) -> bool:
        """Whether the correction runs inside the actor's loss (bypass mode) rather than on the driver."""
        return self.bypass_mode and (self.enabled or self.loss_type != "ppo_clip")

    def _check_rejection(self) -> None:
        if self.rollout_rs is None:
            if self.rollout_rs_threshold is not None:
                raise ConfigFieldError(
                    "rollout_rs_threshold",
                    f"rollout_rs_threshold={self.rollout_rs_threshold!r} is set but rollout_rs is null; name the "
                    "rules (e.g. rollout_rs=seq_mean_k1) or set rollout_rs_threshold=null",
                )
            return
        try:
            parse_rollout_rs(self.rollout_rs)
        except ValueError as err:
            raise ConfigFieldError("rollout_rs", str(err)) from None
        try:
            build_rejection_rules(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as err:
            raise ConfigFieldError("rollout_rs_threshold", str(err)) from None

    @property
    def enabled(self) -> bool:
        """Whether the driver computes importance weights or rejects tokens (rollout_is or rollout_rs set)."""
        return self.rollout_is is not None or self.rollout_rs is not None


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
    use_pf_ppo: bool = False
    """PF-PPO (policy filtration): resample the batch by reward score after GAE advantages (adv_estimator=gae, as
    in verl), before the updates; see pf_ppo."""
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    """PF-PPO's reweighting."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Where the old log-probs come from, and off-policy correction."""
    reward_dpo_coef: float = 5.0
    """PRIME (adv_estimator=prime): weight of the implicit process rewards in the advantage."""
    reward_gt_coef: float = 5.0
    """PRIME (adv_estimator=prime): weight of the outcome (verifier) rewards in the advantage."""

    def __post_init__(self) -> None:
        check_range("gamma", self.gamma, 0.0, 1.0)
        check_range("lam", self.lam, 0.0, 1.0)
        check_choice("kl_penalty", self.kl_penalty, KL_PENALTY_TYPES)
        if self.use_pf_ppo and self.adv_estimator != "gae":
            raise ConfigFieldError(
                "use_pf_ppo",
                f"use_pf_ppo=True with adv_estimator={self.adv_estimator!r}: PF-PPO resamples the batch after GAE "
                "advantages (verl applies it there only); use adv_estimator=gae or use_pf_ppo=False",
            )
