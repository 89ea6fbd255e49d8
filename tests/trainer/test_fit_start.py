"""What `fit` does before its first step, on a fresh or a resumed run: validate or not, stop or train (the driver's
loop against a stub resume and validation; no Ray, no model)."""

from __future__ import annotations

import logging

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo_trainer import RayPPOTrainer

VAL_METRICS = {"val-core/t/acc/mean@1": 0.5}


class Tracking:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, dict(metrics)))


def trainer_resumed_at(step: int, total: int, overrides: list[str]) -> RayPPOTrainer:
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = load_config(["algorithm.adv_estimator=grpo", *overrides])
    trainer.val_dataloader = object()
    trainer.tracking = Tracking()
    trainer.total_training_steps = total
    trainer.initial_val_metrics = {}
    trainer.validations = 0
    trainer._resume = lambda: step
    trainer.profiling = None  # no workers: nothing is profiled

    def validate() -> dict:
        trainer.validations += 1
        return dict(VAL_METRICS)

    trainer.validate = validate
    return trainer


@pytest.mark.parametrize("resumed_at", [0, 3, 5])
def test_val_only_validates_the_checkpoint_it_resumed(resumed_at):
    """A resumed checkpoint's policy is validated and logged at its own step (it was skipped at step > 0, and the
    run printed 'no validation metrics' with data.val_files set)."""
    trainer = trainer_resumed_at(resumed_at, 5, ["trainer.val_only=True"])
    assert trainer.fit() == VAL_METRICS
    assert trainer.validations == 1
    assert trainer.tracking.logged == [(resumed_at, VAL_METRICS)]
    assert trainer.initial_val_metrics == (VAL_METRICS if resumed_at == 0 else {})


def test_a_resumed_run_is_not_validated_again_before_training():
    trainer = trainer_resumed_at(5, 5, [])
    assert trainer.fit() == {} and trainer.validations == 0


def test_a_complete_run_resumed_says_nothing_was_trained(caplog):
    trainer = trainer_resumed_at(5, 5, [])
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.ppo_trainer"):
        trainer.fit()
    assert "resumed at step 5 of 5" in caplog.text and "trainer.val_only=True" in caplog.text
