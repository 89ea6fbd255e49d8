"""Validation counts the scorer calls that failed: their samples score 0, so the accuracy understates the policy,
and the metrics and a warning say by how many."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardResult
from hybridflow.trainer import validation


class FailingScorer:
    """Scores every sample 0 and reports `errors` failed calls per batch."""

    tokenizer = None

    def __init__(self, errors: int) -> None:
        self.errors = errors

    def __call__(self, batch: DataProto) -> RewardResult:
        return RewardResult(reward_tensor=torch.zeros(len(batch), 2),
                            metrics={"reward/errors": float(self.errors), "reward/timeouts": 0.0})


def _batch(rows: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"responses": torch.ones(rows, 2, dtype=torch.long), "response_mask": torch.ones(rows, 2)},
        non_tensors={"data_source": np.array(["gsm8k"] * rows, dtype=object),
                     "uid": np.array([f"u{i}" for i in range(rows)], dtype=object)},
    )


def test_failed_scorings_are_summed_over_the_validation_set_and_warned(monkeypatch, caplog):
    monkeypatch.setattr(validation, "generate_batch", lambda generator, batch, n, **kwargs: (_batch(3), None))
    with caplog.at_level("WARNING", logger="hybridflow.trainer.validation"):
        metrics = validation.run_validation(None, [{}, {}], FailingScorer(errors=2), n=1, pass_rows=False)
    assert metrics["val-aux/reward/errors"] == 4.0 and metrics["val-aux/reward/timeouts"] == 0.0
    assert "4 errors" in caplog.text and "understates" in caplog.text
    caplog.clear()
    clean = validation.run_validation(None, [{}], FailingScorer(errors=0), n=1, pass_rows=False)
    assert clean["val-aux/reward/errors"] == 0.0 and "understates" not in caplog.text


def test_a_column_only_some_batches_have_is_kept_for_their_samples():
    """A scorer key returned for one data source's batches only (e.g. a code scorer's `status`-like numbers) was
    dropped for the whole validation set, since its length did not match the samples'."""
    infos: dict[str, list] = {}
    validation.append_columns(infos, {"reward": [1.0, 0.0], "acc": [1.0, 0.0]}, rows_before=0, rows=2)
    validation.append_columns(infos, {"reward": [0.5], "pass_rate": [0.5]}, rows_before=2, rows=1)
    validation.append_columns(infos, {"reward": [1.0], "acc": [1.0]}, rows_before=3, rows=1)
    assert infos == {"reward": [1.0, 0.0, 0.5, 1.0], "acc": [1.0, 0.0, None, 1.0],
                     "pass_rate": [None, None, 0.5, None]}
