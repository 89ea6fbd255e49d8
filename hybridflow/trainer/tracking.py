"""Experiment tracking: one `Tracking` object fans each step's metrics out to the configured backends.

Backends: `console` (a compact table per step), `file` (jsonl, also what `hybridflow plot` reads),
`tensorboard`, `wandb` (offline mode works without network), `mlflow` (local file store).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from hybridflow import env
from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONSOLE_KEYS = (
    "critic/score/mean",
    "val-core",
    "response_length/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "timing_s/step",
    "perf/throughput",
)


class Backend(Protocol):
    """A tracking backend."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


BACKENDS: Registry[type] = Registry("tracking backend")


@BACKENDS.register("console")
class ConsoleBackend:
    """A compact line per step with the metrics an RL user watches first (all metrics at debug level)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        self.experiment = experiment

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        shown = {key: value for key, value in metrics.items() if key.startswith(CONSOLE_KEYS)}
        cells = "  ".join(f"{key}={_fmt(value)}" for key, value in sorted(shown.items()))
        logger.info("step %d | %s", step, cells)
        logger.debug("step %d all metrics: %s", step, dict(metrics))

    def finish(self) -> None:
        pass


@BACKENDS.register("file")
class FileBackend:
    """Appends one JSON object per step to `run_dir/metrics.jsonl`."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self.handle = self.path.open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.handle.write(json.dumps({"step": step, **{k: _plain(v) for k, v in metrics.items()}}) + "\n")
        self.handle.flush()

    def finish(self) -> None:
        self.handle.close()


@BACKENDS.register("tensorboard")
class TensorboardBackend:
    """Scalars into `run_dir/tensorboard/`."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def wandb_mode_for(chosen: str | None, has_credentials: bool) -> str:
    """The mode a wandb run starts in: the user's `WANDB_MODE` when set; else online with an API key, and offline
    (a local run that `wandb sync` uploads later) without one, rather than stopping at a login prompt."""
    if chosen:
        return chosen
    return "online" if has_credentials else "offline"


@BACKENDS.register("wandb")
class WandbBackend:
    """Weights & Biases under `run_dir/wandb/`; offline when no API key is set (see `wandb_mode_for`)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        mode = wandb_mode_for(env.wandb_mode(), env.wandb_has_credentials())
        proxy = (config.get("trainer") or {}).get("wandb_proxy")  # the run's trainer.wandb_proxy, as verl reads it
        settings = wandb.Settings(https_proxy=proxy) if proxy else None
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir), mode=mode,
                              settings=settings)
        if mode == "offline":
            logger.warning(
                "wandb: no API key (WANDB_API_KEY or `wandb login`) and WANDB_MODE unset, so this run logs offline "
                "to %s; upload it with `wandb sync %s`", self.run.dir, Path(self.run.dir).parent,
            )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


@BACKENDS.register("mlflow")
class MlflowBackend:
    """MLflow into a local file store under `run_dir/mlruns` unless MLFLOW_TRACKING_URI is set."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict) -> None:
        import mlflow

        mlflow.set_tracking_uri(env.mlflow_tracking_uri() or (run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=experiment)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {key.replace("@", "_at_"): value for key, value in metrics.items()}
        self.mlflow.log_metrics(clean, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class Tracking:
    """Logs each step's metrics to every backend named in `trainer.logger`."""

    def __init__(self, backends: list[str], run_dir: str | os.PathLike, project: str, experiment: str, config: dict) -> None:
        self.run_dir = Path(run_dir)
        self.backends = [BACKENDS.get(name)(self.run_dir, project, experiment, config) for name in backends]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the numeric metrics of step `step` (non-numbers are dropped)."""
        numeric = {key: float(value) for key, value in metrics.items() if _is_number(value)}
        for backend in self.backends:
            backend.log(numeric, step)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()


def _is_number(value: Any) -> bool:
    if isinstance(value, (bool, str)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _plain(value: float) -> float | None:
    return None if math.isnan(value) else value


def _fmt(value: float) -> str:
    return f"{value:.4g}"
