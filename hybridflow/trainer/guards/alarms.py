"""Alarms over a step's metrics: the silent ways an RL run stops learning, made loud (issue 31).

Each alarm watches one metric for `alarms.patience_steps` consecutive steps: the rollout/training log-prob gap,
entropy collapse, response-length saturation, reward flatlines and zero-advantage groups. The math is pure functions
(`compute_*`, `is_sustained`); `AlarmMonitor` keeps the short history on the driver, logs each alarm once with its
numbers and what to check, records `alarms/<name>` (1.0 while firing) in the step's metrics, and says whether the
run must stop (`alarms.stop_on`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hybridflow.trainer.guards.config import AlarmName, AlarmsConfig

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- pure functions
def compute_flat_reward_group_frac(scores: torch.Tensor, group_ids: Sequence) -> float:
    """Share of prompt groups whose samples all got the same reward (GRPO learns nothing from them).

    scores: (bs,) float, each sample's sequence reward; group_ids: (bs,) the prompt (uid) of each sample -> [0, 1].
    """
    groups = _group_rows(group_ids)
    flat = sum(1 for rows in groups.values() if bool((scores[rows] == scores[rows[0]]).all()))
    return flat / max(len(groups), 1)


def compute_zero_adv_group_frac(advantages: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence) -> float:
    """Share of prompt groups whose every response token has advantage 0 (no gradient from the policy loss).

    advantages, response_mask: (bs, response_len); group_ids: (bs,) -> [0, 1].
    """
    groups = _group_rows(group_ids)
    nonzero = ((advantages != 0) & response_mask.bool()).any(dim=-1)  # (bs,)
    zero = sum(1 for rows in groups.values() if not bool(nonzero[rows].any()))
    return zero / max(len(groups), 1)


def is_sustained(values: Sequence[float], threshold: float, above: bool, patience: int) -> bool:
    """Whether the last `patience` values are all past `threshold` (strictly above it, or below it)."""
    if len(values) < patience:
        return False
    recent = list(values)[-patience:]
    return all(value > threshold if above else value < threshold for value in recent)


def _group_rows(group_ids: Sequence) -> dict[object, list[int]]:
    rows: dict[object, list[int]] = {}
    for row, uid in enumerate(group_ids):
        rows.setdefault(uid, []).append(row)
    return rows


# ----------------------------------------------------------------------------- the monitor
@dataclass(frozen=True)
class AlarmSpec:
    """One alarm: the metric it watches, its direction and threshold field, and what a user should check."""

    name: AlarmName
    metric: str
    above: bool
    threshold_field: str | None
    """The `AlarmsConfig` field holding the threshold; None: a fixed threshold (`fixed`)."""
    check: str
    fixed: float = 0.0


ALARMS: tuple[AlarmSpec, ...] = (
    AlarmSpec("logprob_mismatch", "training/rollout_probs_diff_mean", True, "logprob_mismatch_max",
              "the rollout and training engines disagree on token probabilities: check the weight hand-over, dtypes "
              "(bf16 rollout vs fp32 training), sampling params (temperature) and rollout correction"),
    AlarmSpec("entropy_collapse", "actor/entropy", False, "entropy_min",
              "the policy became (near) deterministic: lower the learning rate, add entropy_coeff, raise "
              "clip_ratio_high (DAPO clip-higher) or check for reward hacking"),
    AlarmSpec("length_saturation", "response_length/clip_ratio", True, "length_clip_ratio_max",
              "most responses hit rollout.response_length: they are truncated, so the reward sees no answer; raise "
              "the length limit or check for repetition loops"),
    AlarmSpec("reward_flatline", "guards/flat_reward_group_frac", True, None,
              "every prompt group's samples got the same reward, so GRPO-style advantages are all 0: check the "
              "reward function and ground truth, the data's difficulty and rollout.n / temperature", fixed=1.0 - 1e-9),
    AlarmSpec("nonfinite_grads", "actor/num_skipped_steps", True, None,
              "the actor's gradient norm was NaN or inf, so its optimizer steps were skipped and the policy did not "
              "move: check the rewards and advantages for NaN, the learning rate, and bf16 overflow (grad_clip)"),
    AlarmSpec("zero_advantage", "guards/zero_adv_group_frac", True, "zero_adv_group_frac_max",
              "most prompt groups give no gradient: tasks too easy or too hard, or a reward with too few values; "
              "consider dynamic sampling (algorithm.filter_groups)"),
)


class AlarmError(RuntimeError):
    """An alarm listed in `trainer.guards.alarms.stop_on` fired: the run stopped after its checkpoint."""


class AlarmMonitor:
    """Driver-side state of the alarms: the last `patience_steps` values of each watched metric."""

    def __init__(self, config: AlarmsConfig) -> None:
        self.config = config
        self.history: dict[str, deque[float]] = {spec.name: deque(maxlen=config.patience_steps) for spec in ALARMS}
        self.logged: set[str] = set()

    def threshold(self, spec: AlarmSpec) -> float:
        return spec.fixed if spec.threshold_field is None else float(getattr(self.config, spec.threshold_field))

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Record this step's values, add `alarms/<name>` to `metrics`; the alarms firing now."""
        if not self.config.enable:
            return []
        firing = []
        for spec in ALARMS:
            if spec.metric not in metrics:  # e.g. no entropy metric, no rollout log-probs: this alarm sleeps
                continue
            history = self.history[spec.name]
            history.append(float(metrics[spec.metric]))
            fired = is_sustained(history, self.threshold(spec), spec.above, self.config.patience_steps)
            metrics[f"alarms/{spec.name}"] = float(fired)
            if fired:
                firing.append(spec.name)
                if spec.name not in self.logged:
                    self.logged.add(spec.name)
                    logger.warning("%s", self.describe(spec, step))
        return firing

    def describe(self, spec: AlarmSpec, step: int) -> str:
        """The alarm's log line: the metric's recent values against its threshold, and what to check."""
        values = ", ".join(f"{value:.4g}" for value in self.history[spec.name])
        side = "above" if spec.above else "below"
        limit = f"{self.threshold(spec):g}" if spec.threshold_field is not None else (
            "0 (no skipped step)" if spec.fixed == 0.0 else "1 (every group)")
        setting = "" if spec.threshold_field is None else f" (trainer.guards.alarms.{spec.threshold_field})"
        return (
            f"ALARM {spec.name} at step {step}: {spec.metric} was {side} {limit}{setting} for the last "
            f"{self.config.patience_steps} steps: [{values}]. Check: {spec.check}"
        )

    def stop_error(self, step: int, firing: Sequence[str]) -> AlarmError | None:
        """The error that stops the run, when a firing alarm is in `stop_on`; else None."""
        stopping = [spec for spec in ALARMS if spec.name in firing and spec.name in self.config.stop_on]
        if not stopping:
            return None
        lines = "\n".join(self.describe(spec, step) for spec in stopping)
        return AlarmError(f"the run stopped (trainer.guards.alarms.stop_on={list(self.config.stop_on)}):\n{lines}")


def compute_group_metrics(tensors: Mapping[str, torch.Tensor], group_ids: Sequence) -> dict[str, float]:
    """The group metrics the reward alarms watch, from a step's batch: `token_level_scores`, `advantages`,
    `response_mask` (bs, response_len) and each sample's prompt uid."""
    metrics = {"guards/flat_reward_group_frac": compute_flat_reward_group_frac(
        tensors["token_level_scores"].sum(dim=-1), group_ids)}
    if "advantages" in tensors:
        metrics["guards/zero_adv_group_frac"] = compute_zero_adv_group_frac(
            tensors["advantages"], tensors["response_mask"], group_ids)
    return metrics
