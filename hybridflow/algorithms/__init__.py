"""RL algorithms as pure, registered torch functions (verl `core_algos` conformant).

Owns: advantage estimators (`advantages`), policy losses (`policy_losses`, with their registry and
config in `policy_loss_registry`), loss aggregation
(`loss_agg`), KL penalties and controllers (`kl`), rollout correction (`rollout_correction`: truncated importance
weights and rejection between rollout and trainer log-probs), the optimal token baseline and its variance proxies
(`optimal_baseline`), the value loss (`value_loss`), entropy
(`entropy`), masked reductions (`masked`), and training / validation metrics (`metrics`,
`validation_metrics`). Nothing here does I/O, reads config objects or talks to other processes.

A verl user porting a custom estimator or loss changes the import to this package:

    from hybridflow.algorithms import register_adv_est, register_policy_loss, agg_loss
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config sections in this
# package import without torch).
_EXPORTS = {
    "ADV_ESTIMATORS": "advantages",
    "AdvantageEstimator": "advantages",
    "EstimatorSpec": "advantages",
    "compute_advantage_by_name": "advantages",
    "compute_gae_advantage_return": "advantages",
    "compute_gpg_outcome_advantage": "advantages",
    "compute_grpo_outcome_advantage": "advantages",
    "compute_grpo_passk_outcome_advantage": "advantages",
    "compute_opo_outcome_advantage": "advantages",
    "compute_reinforce_plus_plus_baseline_outcome_advantage": "advantages",
    "compute_reinforce_plus_plus_outcome_advantage": "advantages",
    "compute_remax_outcome_advantage": "advantages",
    "compute_rloo_outcome_advantage": "advantages",
    "estimator_spec": "advantages",
    "get_adv_estimator_fn": "advantages",
    "register_adv_est": "advantages",
    "compute_entropy_loss": "entropy",
    "entropy_from_logits": "entropy",
    "entropy_from_logits_with_chunking": "entropy",
    "sum_pi_squared_from_logits": "entropy",
    "compute_optimal_token_baseline_advantage": "optimal_baseline",
    "compute_multi_turn_optimal_token_baseline_advantage": "optimal_baseline",
    "variance_proxy_metrics": "optimal_baseline",
    "KL_PENALTY_TYPES": "kl",
    "AdaptiveKLController": "kl",
    "FixedKLController": "kl",
    "KLController": "kl",
    "apply_kl_penalty": "kl",
    "build_kl_controller": "kl",
    "compute_rewards": "kl",
    "get_kl_controller": "kl",
    "kl_penalty": "kl",
    "kl_penalty_forward": "kl",
    "LOSS_AGG_MODES": "loss_agg",
    "LossAggMode": "loss_agg",
    "agg_loss": "loss_agg",
    "clip_by_value": "masked",
    "masked_mean": "masked",
    "masked_sum": "masked",
    "masked_var": "masked",
    "masked_whiten": "masked",
    "compute_data_metrics": "metrics",
    "compute_response_info": "metrics",
    "compute_stage_throughput_metrics": "metrics",
    "compute_throughput_metrics": "metrics",
    "compute_timing_metrics": "metrics",
    "compute_rollout_probs_diff": "metrics",
    "AlgorithmConfig": "config",
    "FilterGroupsConfig": "config",
    "KLControlConfig": "config",
    "PolicyLossConfig": "config",
    "PPOLossConfig": "config",
    "RolloutCorrectionConfig": "config",
    "ROLLOUT_IS_LEVELS": "rollout_correction",
    "ROLLOUT_RS_OPTIONS": "rollout_correction",
    "compute_offpolicy_metrics": "rollout_correction",
    "compute_rollout_correction": "rollout_correction",
    "compute_rollout_is_weights": "rollout_correction",
    "compute_rollout_log_ratio": "rollout_correction",
    "compute_rollout_rejection_mask": "rollout_correction",
    "POLICY_LOSSES": "policy_loss_registry",
    "compute_policy_loss_from_config": "policy_loss_registry",
    "get_policy_loss_fn": "policy_loss_registry",
    "register_policy_loss": "policy_loss_registry",
    "compute_policy_loss_cispo": "policy_losses",
    "compute_policy_loss_clip_cov": "policy_losses",
    "compute_policy_loss_geo_mean": "policy_losses",
    "compute_policy_loss_gpg": "policy_losses",
    "compute_policy_loss_gspo": "policy_losses",
    "compute_policy_loss_kl_cov": "policy_losses",
    "compute_policy_loss_sapo": "policy_losses",
    "compute_policy_loss_vanilla": "policy_losses",
    "bootstrap_metric": "validation_metrics",
    "calc_maj_val": "validation_metrics",
    "flatten_validation_metrics": "validation_metrics",
    "process_validation_metrics": "validation_metrics",
    "compute_value_loss": "value_loss",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
