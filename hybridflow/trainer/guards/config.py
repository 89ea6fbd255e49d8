"""The guards' config sections (`trainer.guards.*`), apart from the guards' torch code so the config schema imports
them without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, check_range

__all__ = ["AlarmName", "AlarmsConfig", "GuardsConfig", "MemoryWatchConfig", "unwatchable_alarms"]

AlarmName = Literal["logprob_mismatch", "entropy_collapse", "length_saturation", "reward_flatline", "zero_advantage",
                    "nonfinite_grads"]


@dataclass(frozen=True, kw_only=True)
class AlarmsConfig:
    """trainer.guards.alarms: thresholds of the alarms on a step's metrics."""

    enable: bool = True
    """Watch the step metrics below and log (once per alarm) when one stays past its threshold."""
    patience_steps: int = 3
    """Consecutive steps a metric must stay past its threshold before its alarm fires."""
    logprob_mismatch_max: float = 0.1
    """logprob_mismatch fires when training/rollout_probs_diff_mean (mean |p_rollout - p_train| per token) is above."""
    entropy_min: float = 0.01
    """entropy_collapse fires when actor/entropy (nats per token) is below (needs the entropy metric)."""
    length_clip_ratio_max: float = 0.5
    """length_saturation fires when response_length/clip_ratio (share of responses at the length limit) is above."""
    zero_adv_group_frac_max: float = 0.9
    """zero_advantage fires when guards/zero_adv_group_frac (prompt groups whose advantages are all 0) is above.
    reward_flatline has no threshold: it fires when every group's rewards are identical (guards/flat_reward_group_frac
    is 1); nor has nonfinite_grads: it fires when actor optimizer steps were skipped for a NaN/inf gradient norm
    (actor/num_skipped_steps above 0)."""
    stop_on: list[AlarmName] = field(default_factory=list)
    """Alarms that stop the run (after the step's checkpoint) instead of only logging: any of logprob_mismatch,
    entropy_collapse, length_saturation, reward_flatline, zero_advantage, nonfinite_grads."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("patience_steps", self.patience_steps, 1)
        check_at_least("logprob_mismatch_max", self.logprob_mismatch_max, 0.0)
        check_at_least("entropy_min", self.entropy_min, 0.0)
        check_range("length_clip_ratio_max", self.length_clip_ratio_max, 0.0, 1.0, high_open=True)
        check_range("zero_adv_group_frac_max", self.zero_adv_group_frac_max, 0.0, 1.0, high_open=True)
        if self.stop_on and not self.enable:
            raise ConfigFieldError("stop_on", f"stop_on={self.stop_on} needs enable=True (the alarms are off)")


def unwatchable_alarms(*, bypass_mode: bool, rollout_log_probs: bool, entropy_in_update: bool) -> dict[str, str]:
    """The alarms whose metric a run never produces, with why and the setting that would produce it.

    bypass_mode: algorithm.rollout_correction.bypass_mode (the rollout's log-probs stand for the old ones, so the
        trainer computes none to compare them with, nor an old-log-prob pass's entropy);
    rollout_log_probs: the rollout engine returns its log-probs (the other side of logprob_mismatch's gap);
    entropy_in_update: the update computes the entropy (entropy_coeff != 0 or actor.calculate_entropy).
    """
    unwatchable = {}
    if bypass_mode:
        unwatchable["logprob_mismatch"] = (
            "algorithm.rollout_correction.bypass_mode=True takes the rollout's log-probs as the old ones, so no "
            "trainer log-probs are computed to compare with them (bypass_mode=False does)"
        )
        if not entropy_in_update:
            unwatchable["entropy_collapse"] = (
                "bypass mode runs no old-log-prob pass, whose entropy the alarm reads; set "
                "actor_rollout_ref.actor.calculate_entropy=True"
            )
    elif not rollout_log_probs:
        unwatchable["logprob_mismatch"] = (
            "the rollout engine returns no log-probs to compare with the trainer's; use a rollout.name that does"
        )
    return unwatchable


@dataclass(frozen=True, kw_only=True)
class MemoryWatchConfig:
    """trainer.guards.memory: the per-node host-memory budget of the run's worker processes."""

    enable: bool = True
    """Ask every worker process for its memory after each step (memory/* metrics) and hold it against the budget."""
    host_memory_budget_gb: Optional[float] = None
    """GB (1e9 bytes) that the peak RSS of this run's worker processes on one node may sum to; past it the run saves a
    checkpoint and stops. None: 90% of the node's physical memory (the rest for the OS, Ray and the driver)."""
    warn_fraction: float = 0.9
    """Share of the budget at which a warning names the process that grew (logged once per node)."""
    within_step: bool = True
    """Also hold the budget during each call: a thread in every worker process sums its node's worker processes'
    resident memory every poll_interval_s and, at the budget, stops the largest one's call (the run stops with its
    error; the last checkpoint stays). Ray workers on Linux."""
    poll_interval_s: float = 0.5
    """Seconds between two looks of the within-step watch."""

    def __post_init__(self) -> None:
        check_positive("host_memory_budget_gb", self.host_memory_budget_gb, allow_none=True)
        check_range("warn_fraction", self.warn_fraction, 0.0, 1.0, low_open=True)
        check_positive("poll_interval_s", self.poll_interval_s)


@dataclass(frozen=True, kw_only=True)
class GuardsConfig:
    """trainer.guards: checks after every step that stop a run from failing silently."""

    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    """Alarms on the step's metrics."""
    memory: MemoryWatchConfig = field(default_factory=MemoryWatchConfig)
    """The worker processes' host-memory budget."""
