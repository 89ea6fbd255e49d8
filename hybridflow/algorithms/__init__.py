"""RL algorithms as pure, registered torch functions (verl `core_algos` conformant).

Owns: advantage estimators (`advantages`), policy losses (`policy_losses`, with their registry and
config in `policy_loss_registry`), loss aggregation
(`loss_agg`), KL penalties and controllers (`kl`), rollout correction (`rollout_correction`: truncated importance
weights and rejection between rollout and trainer log-probs), the value loss (`value_loss`), entropy
(`entropy`), masked reductions (`masked`), and training / validation metrics (`metrics`,
`validation_metrics`). Nothing here does I/O, reads config objects or talks to other processes.

A verl user porting a custom estimator or loss changes the import to this package:

    from hybridflow.algorithms import register_adv_est, register_policy_loss, agg_loss
"""

from hybridflow.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    EstimatorSpec,
    compute_advantage_by_name,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    estimator_spec,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.entropy import compute_entropy_loss, entropy_from_logits, entropy_from_logits_with_chunking
from hybridflow.algorithms.kl import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from hybridflow.algorithms.loss_agg import LOSS_AGG_MODES, LossAggMode, agg_loss
from hybridflow.algorithms.masked import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algorithms.metrics import (
    compute_data_metrics,
    compute_response_info,
    compute_stage_throughput_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_rollout_probs_diff,
)
from hybridflow.algorithms.config import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PolicyLossConfig,
    PPOLossConfig,
    RolloutCorrectionConfig,
)
from hybridflow.algorithms.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    compute_offpolicy_metrics,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_log_ratio,
    compute_rollout_rejection_mask,
)
from hybridflow.algorithms.policy_loss_registry import (
    POLICY_LOSSES,
    compute_policy_loss_from_config,
    get_policy_loss_fn,
    register_policy_loss,
)
from hybridflow.algorithms.policy_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from hybridflow.algorithms.validation_metrics import (
    bootstrap_metric,
    calc_maj_val,
    flatten_validation_metrics,
    process_validation_metrics,
)
from hybridflow.algorithms.value_loss import compute_value_loss

__all__ = [
    "compute_rollout_probs_diff",
    # advantages
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
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
    # policy losses
    "POLICY_LOSSES",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "PolicyLossConfig",
    "PPOLossConfig",
    "RolloutCorrectionConfig",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss_from_config",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_geo_mean",
    # aggregation, value, entropy, masked
    "LOSS_AGG_MODES",
    "LossAggMode",
    "agg_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "compute_entropy_loss",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "clip_by_value",
    # kl
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
    # rollout correction
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "compute_rollout_log_ratio",
    "compute_rollout_is_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_rollout_correction",
    # metrics
    "compute_response_info",
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughput_metrics",
    "compute_stage_throughput_metrics",
    "bootstrap_metric",
    "calc_maj_val",
    "process_validation_metrics",
    "flatten_validation_metrics",
]
