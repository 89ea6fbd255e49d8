"""Tracking backends (console, file, tensorboard), the plots and the validation summary."""

from __future__ import annotations

import json
import logging

import pytest

from hybridflow.trainer.plot import plot_run
from hybridflow.trainer.run import summarize_validation
from hybridflow.trainer.tracking import BACKENDS, Tracking


def test_file_backend_writes_numeric_metrics_per_step(tmp_path):
    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    tracking.log({"critic/score/mean": 0.5, "note": "text is dropped", "flag": True}, step=1)
    tracking.log({"critic/score/mean": 0.75, "val-core/x/acc/mean@1": 0.25}, step=2)
    tracking.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 1, "critic/score/mean": 0.5},
        {"step": 2, "critic/score/mean": 0.75, "val-core/x/acc/mean@1": 0.25},
    ]


def test_console_backend_shows_the_watched_metrics(tmp_path, caplog):
    tracking = Tracking(["console"], tmp_path, "p", "e", {})
    with caplog.at_level(logging.INFO, logger="hybridflow.trainer.tracking"):
        tracking.log({"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "unwatched/key": 1.0}, step=3)
    assert "step 3" in caplog.text and "critic/score/mean=0.5" in caplog.text and "actor/pg_loss=-0.25" in caplog.text
    assert "unwatched" not in caplog.text


def test_tensorboard_backend_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    tracking = Tracking(["tensorboard"], tmp_path, "p", "e", {})
    tracking.log({"critic/score/mean": 0.5}, step=1)
    tracking.finish()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_backend_lists_known_ones(tmp_path):
    with pytest.raises(KeyError, match="unknown tracking backend 'printer'.*console"):
        Tracking(["printer"], tmp_path, "p", "e", {})
    assert {"console", "file", "tensorboard", "wandb", "mlflow"} <= set(BACKENDS.names())


def test_plots_are_written_for_panels_with_data(tmp_path):
    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    for step in range(1, 4):
        tracking.log({"critic/score/mean": step / 10, "actor/entropy": 1.0 / step, "response_length/mean": 20.0}, step)
    tracking.log({"val-core/x/acc/mean@1": 0.3}, step=3)
    tracking.finish()
    names = sorted(path.name for path in plot_run(tmp_path))
    assert names == ["entropy.png", "response_length.png", "reward.png", "validation.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in names)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_run(tmp_path / "empty")


def test_validation_summary_table():
    table = summarize_validation({"val-core/a/acc/mean@1": 0.2}, {"val-core/a/acc/mean@1": 0.35, "val-aux/z": 1.0})
    assert table.splitlines() == ["validation metric      before   after", "val-core/a/acc/mean@1  0.2000  0.3500"]
    assert summarize_validation({}, {}).startswith("no validation metrics")
