"""Tracking backends (console, file, tensorboard), the plots and the validation summary."""

from __future__ import annotations

import json
import logging

import pytest

from hybridflow.trainer.plot import metrics_by_step, plot_run, read_metrics, validation_keys
from hybridflow.trainer.run import summarize_validation
from hybridflow.trainer.tracking import BACKENDS, Tracking, wandb_mode_for


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


def test_metrics_by_step_merges_the_records_of_one_step(tmp_path):
    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    tracking.log({"val-core/x/acc/mean@1": 0.25}, step=0)
    tracking.log({"critic/score/mean": 0.5}, step=1)
    tracking.log({"val-core/x/acc/mean@1": 0.5}, step=1)
    tracking.finish()
    assert metrics_by_step(tmp_path) == {
        0: {"step": 0, "val-core/x/acc/mean@1": 0.25},
        1: {"step": 1, "critic/score/mean": 0.5, "val-core/x/acc/mean@1": 0.5},
    }


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


def test_wandb_mode_follows_the_user_then_the_credentials():
    assert wandb_mode_for("disabled", has_credentials=True) == "disabled"
    assert wandb_mode_for("online", has_credentials=False) == "online"
    assert wandb_mode_for(None, has_credentials=True) == "online"
    assert wandb_mode_for(None, has_credentials=False) == "offline"


def test_wandb_without_a_key_logs_offline_into_the_run_directory(tmp_path, monkeypatch, caplog):
    """verl's command lines name wandb; with no API key the run logs locally (for `wandb sync`), not stops."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc: no `wandb login`
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.tracking"):
        tracking = Tracking(["wandb"], run_dir, "p", "e", {"lr": 1e-6})
    tracking.log({"critic/score/mean": 0.5}, step=1)
    tracking.finish()
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert "logs offline" in caplog.text and "wandb sync" in caplog.text


def test_trainer_s_wandb_proxy_reaches_wandb_s_settings(tmp_path, monkeypatch):
    """verl's `+trainer.wandb_proxy` (wandb.Settings(https_proxy)); refused without wandb among the loggers."""
    import wandb

    from hybridflow.trainer.config.schema import RunConfig
    from hybridflow.utils.config import ConfigFieldError

    seen = {}
    monkeypatch.setenv("WANDB_MODE", "disabled")  # chosen by the user: no offline-mode notice reads the run's dir
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.update(kwargs) or object())
    Tracking(["wandb"], tmp_path, "p", "e", {"trainer": {"wandb_proxy": "http://proxy.local:3128"}})
    assert seen["settings"].https_proxy == "http://proxy.local:3128"
    Tracking(["wandb"], tmp_path, "p", "e", {"trainer": {"wandb_proxy": None}})
    assert seen["settings"] is None
    with pytest.raises(ConfigFieldError, match="wandb_proxy='http://p:1' is wandb's proxy, but logger=\\['console'\\]"):
        RunConfig(wandb_proxy="http://p:1", logger=["console"])


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


def test_a_file_the_plots_did_not_write_is_never_written_over(tmp_path, caplog):
    """A user's own reward.png (a PNG from elsewhere, or any file) in the run's plots/ stays as it was; the
    plots' own files are rewritten on the next call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    for step in range(1, 3):
        tracking.log({"critic/score/mean": step / 10, "actor/entropy": 1.0 / step}, step)
    tracking.finish()
    (tmp_path / "plots").mkdir()
    figure = plt.figure()
    figure.savefig(tmp_path / "plots" / "reward.png")  # a PNG, but not one of the run's
    plt.close(figure)
    (tmp_path / "plots" / "entropy.png").write_text("my notes")
    users = {name: (tmp_path / "plots" / name).read_bytes() for name in ("reward.png", "entropy.png")}
    with caplog.at_level("WARNING", logger="hybridflow.trainer.plot"):
        assert plot_run(tmp_path) == []
    assert {name: (tmp_path / "plots" / name).read_bytes() for name in users} == users
    assert "reward.png was not written by hybridflow's plots" in caplog.text and "hybridflow plot" in caplog.text
    for name in users:
        (tmp_path / "plots" / name).unlink()
    assert sorted(path.name for path in plot_run(tmp_path)) == ["entropy.png", "reward.png"]
    first = (tmp_path / "plots" / "reward.png").stat().st_mtime_ns
    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    tracking.log({"critic/score/mean": 0.9}, 3)
    tracking.finish()
    assert sorted(path.name for path in plot_run(tmp_path)) == ["entropy.png", "reward.png"]  # its own: rewritten
    assert (tmp_path / "plots" / "reward.png").stat().st_mtime_ns >= first


def test_an_agent_run_plots_its_tool_use_and_validation_tool_share(tmp_path):
    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    for step in range(1, 4):
        tracking.log({"tool_calls/used_ratio": step / 4, "agent/truncated": 0.1}, step)
    tracking.log({"val-core/x/acc/mean@1": 0.3, "val-aux/x/tool_used/mean@1": 0.5,
                  "val-aux/x/tool_used/mean@1/ci95_low": 0.4, "val-aux/x/num_turns/mean@1": 2.0}, step=3)
    tracking.finish()
    assert sorted(path.name for path in plot_run(tmp_path)) == ["tools.png", "validation.png"]
    assert validation_keys(read_metrics(tmp_path)) == ["val-aux/x/tool_used/mean@1", "val-core/x/acc/mean@1"]


def test_validation_summary_table():
    table = summarize_validation({"val-core/a/acc/mean@1": 0.2}, {"val-core/a/acc/mean@1": 0.35, "val-aux/z": 1.0})
    assert table.splitlines() == ["validation metric      before  after", "val-core/a/acc/mean@1  0.2000  0.3500"]
    assert summarize_validation({}, {}).startswith("no validation metrics")


def test_validation_summary_shows_each_mean_with_its_interval():
    interval = {"val-aux/a/acc/mean@1/ci95_low": 0.087, "val-aux/a/acc/mean@1/ci95_high": 0.264}
    table = summarize_validation({"val-core/a/acc/mean@1": 0.15625, **interval}, {"val-core/b/acc/mean@1": 0.5})
    assert table.splitlines() == [
        "validation metric      before                 after",
        "val-core/a/acc/mean@1  0.1562 [0.087, 0.264]  -",
        "val-core/b/acc/mean@1  -                      0.5000",
    ]


def test_ema_starts_at_the_first_point_and_follows_the_rest():
    from hybridflow.trainer.plot import compute_ema

    assert compute_ema([1.0, 0.0, 0.0], smoothing=0.5) == [1.0, 0.5, 0.25]
    assert compute_ema([]) == []


def test_validation_plot_draws_the_interval_band(tmp_path):
    import matplotlib.pyplot as plt

    tracking = Tracking(["file"], tmp_path, "p", "e", {})
    for step, (mean, low, high) in enumerate([(0.2, 0.1, 0.3), (0.4, 0.3, 0.5)]):
        aux = {"val-aux/x/acc/mean@1/ci95_low": low, "val-aux/x/acc/mean@1/ci95_high": high}
        tracking.log({"val-core/x/acc/mean@1": mean, **aux}, step=step)
    tracking.finish()
    bands = []
    original = plt.Axes.fill_between
    plt.Axes.fill_between = lambda self, x, y1, y2, **kw: bands.append((list(x), list(y1), list(y2)))
    try:
        plot_run(tmp_path)
    finally:
        plt.Axes.fill_between = original
    assert bands == [([0, 1], [0.1, 0.3], [0.3, 0.5])]


def test_a_run_from_step_0_moves_an_earlier_run_s_metrics_aside_and_a_resume_appends(tmp_path):
    """Running a line twice without checkpoints (verl's default save_freq=-1) appended the second run's steps to
    the first's metrics.jsonl, and the plots mixed them step by step."""
    from hybridflow.trainer.config.schema import RunConfig
    from hybridflow.trainer.scaffold import build_tracking

    run = RunConfig(default_local_dir=str(tmp_path), logger=["file"])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    tracking = build_tracking(run, run)
    tracking.log({"loss": 1.0}, step=1)
    tracking.finish()
    earlier = sorted(tmp_path.glob("metrics.jsonl.before-*"))
    assert len(earlier) == 1 and earlier[0].read_text() == '{"step": 1, "loss": 9.0}\n'
    assert [record["loss"] for record in read_metrics(tmp_path)] == [1.0]
    (tmp_path / "global_step_1").mkdir()
    (tmp_path / "global_step_1" / "driver_state.json").write_text("{}")
    tracking = build_tracking(run, run)  # resumes from global_step_1: the same run goes on
    tracking.log({"loss": 0.5}, step=2)
    tracking.finish()
    assert [record["loss"] for record in read_metrics(tmp_path)] == [1.0, 0.5]
