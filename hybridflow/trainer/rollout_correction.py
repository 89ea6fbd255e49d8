"""Rollout correction on the driver: one call between the old-log-prob pass and the advantages.

`apply_rollout_correction` reads the trainer's `old_log_probs` and the rollout engine's `rollout_log_probs`,
writes truncated importance weights (`rollout_is_weights`, which every registered policy loss multiplies into
its per-token loss) and removes rejected tokens from `response_mask` (so advantages, the actor's and the
critic's losses and their token counts skip them). The math is `hybridflow.algorithms.rollout_correction`.
"""

from __future__ import annotations

from hybridflow.algorithms.config import RolloutCorrectionConfig
from hybridflow.algorithms.rollout_correction import compute_rollout_correction
from hybridflow.protocol import DataProto

__all__ = ["apply_rollout_correction"]


def apply_rollout_correction(batch: DataProto, config: RolloutCorrectionConfig) -> dict[str, float]:
    """Write `rollout_is_weights` (with `config.rollout_is`) and the rejection-masked `response_mask` (with
    `config.rollout_rs`) into `batch.batch`; return verl's `rollout_corr/*` metrics.

    `batch.batch` needs `old_log_probs`, `rollout_log_probs` and `response_mask`, each (bs, response_len).
    The weights and metrics are computed on the mask as it arrives; without `rollout_rs` it is left unchanged.
    """
    missing = [key for key in ("old_log_probs", "rollout_log_probs", "response_mask") if key not in batch.batch.keys()]
    if missing:
        raise ValueError(
            f"algorithm.rollout_correction needs {missing} in the batch: old_log_probs come from the trainer's "
            "old-log-prob pass, rollout_log_probs from the rollout engine"
        )
    weights, mask, metrics = compute_rollout_correction(
        batch.batch["old_log_probs"],
        batch.batch["rollout_log_probs"],
        batch.batch["response_mask"],
        **config.math_kwargs,
    )
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights.to(batch.batch["old_log_probs"].device)
    if config.rollout_rs is not None:
        batch.batch["response_mask"] = mask
    return metrics
