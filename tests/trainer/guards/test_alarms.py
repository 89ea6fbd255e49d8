"""The alarms' pure functions against hand-computed inputs, and the monitor's once-only log and stop."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.trainer.guards.alarms import (
    AlarmMonitor,
    AlarmsConfig,
    compute_flat_reward_group_frac,
    compute_group_metrics,
    compute_zero_adv_group_frac,
    is_sustained,
)


def test_flat_reward_group_frac_counts_groups_with_one_reward():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    # groups: a = {1, 1} flat, b = {0, 1} not, c = {0.5, 0.5} flat -> 2 of 3
    assert compute_flat_reward_group_frac(scores, ["a", "a", "b", "b", "c", "c"]) == pytest.approx(2 / 3)
    assert compute_flat_reward_group_frac(torch.tensor([0.0, 1.0]), ["a", "a"]) == 0.0


def test_zero_adv_group_frac_ignores_padding():
    advantages = torch.tensor([[0.0, 0.0], [0.0, 3.0], [0.5, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])  # row 1's non-zero value is padding
    # group x = rows 0, 1: zero on every response token; group y = rows 2, 3: row 2 has 0.5 -> 1 of 2
    assert compute_zero_adv_group_frac(advantages, mask, ["x", "x", "y", "y"]) == 0.5


def test_is_sustained_needs_patience_consecutive_steps_past_the_threshold():
    assert not is_sustained([0.2, 0.3], 0.1, above=True, patience=3)  # too few steps
    assert is_sustained([0.0, 0.2, 0.3, 0.4], 0.1, above=True, patience=3)
    assert not is_sustained([0.2, 0.05, 0.3], 0.1, above=True, patience=3)
    assert is_sustained([0.005, 0.001], 0.01, above=False, patience=2)
    assert not is_sustained([0.1, 0.1], 0.1, above=True, patience=2)  # strictly past


def test_group_metrics_from_a_batch():
    tensors = {
        "token_level_scores": torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 2.0]]),
        "advantages": torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, -1.0], [1.0, 1.0]]),
        "response_mask": torch.ones(4, 2),
    }
    metrics = compute_group_metrics(tensors, [0, 0, 1, 1])
    assert metrics == {"guards/flat_reward_group_frac": 0.5, "guards/zero_adv_group_frac": 0.5}


def test_monitor_fires_after_patience_logs_once_and_stops_when_asked(caplog):
    monitor = AlarmMonitor(AlarmsConfig(patience_steps=2, logprob_mismatch_max=0.1, stop_on=["reward_flatline"]))
    caplog.set_level(logging.WARNING, logger="hybridflow.trainer.guards.alarms")
    fired = []
    for step, (diff, flat) in enumerate([(0.2, 0.5), (0.3, 1.0), (0.4, 1.0), (0.5, 1.0)], start=1):
        metrics = {"training/rollout_probs_diff_mean": diff, "guards/flat_reward_group_frac": flat}
        fired.append(monitor.observe(step, metrics))
        assert "alarms/logprob_mismatch" in metrics and "alarms/entropy_collapse" not in metrics  # no entropy metric
    assert fired == [[], ["logprob_mismatch"], ["logprob_mismatch", "reward_flatline"],
                     ["logprob_mismatch", "reward_flatline"]]
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 2, logged  # once per alarm, not once per step
    assert "ALARM logprob_mismatch at step 2" in logged[0] and "[0.2, 0.3]" in logged[0]
    assert "trainer.guards.alarms.logprob_mismatch_max" in logged[0] and "Check:" in logged[0]
    assert monitor.stop_error(2, fired[1]) is None  # logprob_mismatch is not in stop_on
    error = monitor.stop_error(3, fired[2])
    assert error is not None and "reward_flatline at step 3" in str(error) and "stop_on" in str(error)


def test_entropy_collapse_and_length_saturation_fire_on_their_metrics():
    monitor = AlarmMonitor(AlarmsConfig(patience_steps=1, entropy_min=0.05, length_clip_ratio_max=0.5))
    metrics = {"actor/entropy": 0.01, "response_length/clip_ratio": 0.75, "guards/zero_adv_group_frac": 0.5}
    assert monitor.observe(1, metrics) == ["entropy_collapse", "length_saturation"]
    assert metrics["alarms/zero_advantage"] == 0.0


def test_skipped_optimizer_steps_fire_the_nonfinite_grads_alarm_and_can_stop_the_run(caplog):
    """A NaN/inf gradient norm skips the actor's step with a warning per step in the worker's log; a run whose steps
    were all skipped still 'finished'. The alarm reads the update's actor/num_skipped_steps."""
    monitor = AlarmMonitor(AlarmsConfig(patience_steps=2, stop_on=["nonfinite_grads"]))
    caplog.set_level(logging.WARNING, logger="hybridflow.trainer.guards.alarms")
    fired = [monitor.observe(step, {"actor/num_skipped_steps": skipped})
             for step, skipped in enumerate([0.0, 1.0, 0.5, 0.0], start=1)]
    assert fired == [[], [], ["nonfinite_grads"], []]
    assert "ALARM nonfinite_grads at step 3" in caplog.text and "above 0 (no skipped step)" in caplog.text
    assert "nonfinite_grads at step 3" in str(monitor.stop_error(3, fired[2]))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="patience_steps"):
        AlarmsConfig(patience_steps=0)
    with pytest.raises(ValueError, match="length_clip_ratio_max"):
        AlarmsConfig(length_clip_ratio_max=1.0)
    with pytest.raises(ValueError, match="stop_on"):
        AlarmsConfig(stop_on=["not_an_alarm"])
    with pytest.raises(ValueError, match="stop_on"):
        AlarmsConfig(enable=False, stop_on=["reward_flatline"])
