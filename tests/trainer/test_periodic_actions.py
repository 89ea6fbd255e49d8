"""When the trainers validate and checkpoint: verl's PPO meaning of `test_freq` / `save_freq` (<= 0: never during
training) and its SFT meaning (<= 0: at the last step only); how many steps a run takes."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config.schema import RunConfig
from hybridflow.trainer.scaffold import due, total_steps


@pytest.mark.parametrize("freq, expected", [(2, [2, 4, 5]), (5, [5]), (1, [1, 2, 3, 4, 5]), (7, [5]), (-1, []), (0, [])])
def test_ppo_runs_every_freq_steps_and_at_the_last_or_never(freq, expected):
    assert [step for step in range(1, 6) if due(freq, step, is_last=step == 5)] == expected


@pytest.mark.parametrize("freq, expected", [(2, [2, 4, 5]), (-1, [5]), (0, [5])])
def test_sft_keeps_the_last_step_when_turned_off(freq, expected):
    assert [step for step in range(1, 6) if due(freq, step, is_last=step == 5, at_end_when_off=True)] == expected


def test_the_data_caps_the_steps_and_says_so(caplog):
    """verl's loop ends with its last epoch: total_training_steps beyond epochs x batches is cut, with a warning."""
    assert total_steps(RunConfig(total_epochs=2), 64) == 128
    assert total_steps(RunConfig(total_epochs=2, total_training_steps=40), 64) == 40
    assert not caplog.records
    assert total_steps(RunConfig(total_epochs=1, total_training_steps=120), 64) == 64
    assert "total_training_steps=120 but trainer.total_epochs=1 x 64 batches per epoch = 64" in caplog.text
