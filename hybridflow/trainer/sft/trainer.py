"""`SFTTrainer`: the driver loop of supervised fine-tuning, and `run_sft` which assembles a run from a config.

    for batch in dataloader:
        metrics = workers.train_step(batch)       # one optimizer step over all ranks
        every test_freq steps: workers.eval_loss  # token-mean NLL over the validation set
        every save_freq steps: workers.save_checkpoint(global_step_N)

Checkpoints are `{trainer.default_local_dir}/global_step_N/` (engine shards, `huggingface/`, `lora_adapter/`
for LoRA, `driver_state.json`), written atomically; `hybridflow merge --local_dir .../global_step_N` exports one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from hybridflow.data.config import SFTDataConfig
from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.protocol import DataProto
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer import checkpointing
from hybridflow.trainer.config.schema import SFTConfig
from hybridflow.trainer.sft.validate import sft_resumed_settings
from hybridflow.trainer.scaffold import (
    WorkerProcesses,
    build_tokenizer,
    build_tracking,
    build_train_loader,
    build_val_loader,
    due,
    heartbeat,
    init_ray,
    run_dir,
    total_steps,
    worker_metrics,
    worker_runtime,
    write_ray_timeline,
)
from hybridflow.trainer.tracking import Tracking
from hybridflow.workers import SFTWorker

logger = logging.getLogger(__name__)


def build_sft_dataloaders(data: SFTDataConfig, tokenizer: Any) -> tuple[DataLoader, DataLoader | None]:
    """Training loader (seeded, resumable sampler, full batches only) and validation loader of `data.*`."""
    train_set = SFTDataset(data.train_files, tokenizer, data, max_samples=data.train_max_samples)
    train_loader = build_train_loader(train_set, data.train_batch_size, data.shuffle, data.seed, train_set.collate)
    if not data.val_files:
        return train_loader, None
    val_set = SFTDataset(data.val_files, tokenizer, data, max_samples=data.val_max_samples)
    return train_loader, build_val_loader(val_set, data.train_batch_size, val_set.collate)


def build_sft_workers(cfg: SFTConfig, total_training_steps: int) -> WorkerProcesses:
    """One SFTWorker per rank (in the driver with `trainer.local_mode`), models loaded."""
    worker = RayClassWithInitArgs(SFTWorker, cfg.engine_config(total_training_steps),
                                  worker_runtime(cfg.trainer, total_training_steps), cfg.trainer.checkpoint,
                                  cfg.data.token_budget)
    processes = WorkerProcesses(cfg.trainer, worker, name_prefix="hybridflow_sft")
    processes.group.init_model()
    return processes


class SFTTrainer:
    """Runs SFT over a worker group; see the module docstring for the loop."""

    def __init__(self, config: SFTConfig, train_loader: DataLoader, val_loader: DataLoader | None,
                 tracking: Tracking, console: bool = True) -> None:
        self.config = config
        self.train_loader, self.val_loader = train_loader, val_loader
        self.tracking, self.console = tracking, console
        self.total_training_steps = total_steps(config.trainer, len(train_loader))
        self.global_steps = 0
        self.processes: WorkerProcesses | None = None
        self.history: list[dict[str, float]] = []

    @property
    def workers(self) -> Any:
        """The SFT worker group."""
        return self.processes.group

    def init_workers(self) -> None:
        """Start the workers and load the model."""
        self.processes = build_sft_workers(self.config, self.total_training_steps)

    def fit(self) -> dict[str, float]:
        """Train until `total_training_steps`; returns {'val/loss_before', 'val/loss', ...} where measured."""
        cfg = self.config.trainer
        self.global_steps = self._resume()
        summary: dict[str, float] = {}
        if self.val_loader is not None and cfg.val_before_train and self.global_steps == 0:
            summary["val/loss_before"] = self.validate()
            self._log({"val/loss": summary["val/loss_before"]}, step=0)
        while self.global_steps < self.total_training_steps:
            for batch in self.train_loader:
                self.global_steps += 1
                alive = heartbeat([self.processes], cfg.heartbeat_timeout_s)
                metrics = {**alive, **self.train_step(batch)}
                is_last = self.global_steps >= self.total_training_steps
                if self.val_loader is not None and due(self._steps(cfg.test_freq), self.global_steps, is_last,
                                                       at_end_when_off=True):
                    metrics["val/loss"] = summary["val/loss"] = self.validate()
                if due(self._steps(cfg.save_freq), self.global_steps, is_last, at_end_when_off=True):
                    self.save_checkpoint()
                self._log(metrics, step=self.global_steps)
                if is_last:
                    break
        summary["train/loss"] = self.history[-1]["train/loss"] if self.history else float("nan")
        return summary

    def _steps(self, freq: int | str) -> int:
        """A frequency in steps: after_each_epoch is the batches of one epoch."""
        return len(self.train_loader) if freq == "after_each_epoch" else freq

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step; returns the step's metrics (loss averaged over ranks)."""
        start = time.perf_counter()
        metrics = worker_metrics(self.workers.train_step(DataProto.from_single_dict(batch)))
        elapsed = time.perf_counter() - start
        num_tokens = int(batch["attention_mask"].sum())
        metrics.update({
            "timing_s/step": elapsed,
            "perf/throughput": num_tokens / elapsed / self.config.trainer.world_size,
            "train/num_tokens": num_tokens,
            "train/num_loss_tokens": int(batch["loss_mask"][:, 1:].sum()),
            "train/epoch": (self.global_steps - 1) // max(len(self.train_loader), 1),
            "training/global_step": self.global_steps,
        })
        self.history.append(metrics)
        return metrics

    def validate(self) -> float:
        """Token-mean NLL over the loss-masked tokens of the whole validation set."""
        nll, tokens = 0.0, 0.0
        for batch in self.val_loader:
            output = self.workers.eval_loss(DataProto.from_single_dict(batch))
            nll += float(output.batch["nll_sum"].double().sum())
            tokens += float(output.batch["num_tokens"].double().sum())
        if tokens == 0:  # a 0.0 loss would read as a perfect model
            raise ValueError(
                "the validation set has no token in the loss (every response masked, or cut off by "
                "data.max_length with data.truncation): check data.val_files, data.max_length and the response keys"
            )
        return nll / tokens

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Checkpoint step `global_steps` atomically (staged, then renamed)."""
        return checkpointing.save_checkpoint(
            run_dir(self.config.trainer),
            self.global_steps,
            lambda staging: self.workers.save_checkpoint(str(staging)),
            {"sampler": self.train_loader.sampler.state_dict(), "settings": sft_resumed_settings(self.config)},
            self.config.trainer.max_ckpt_to_keep,
        )

    def _resume(self) -> int:
        path = checkpointing.find_resume_dir(self.config.trainer, run_dir(self.config.trainer))
        checkpointing.check_shared_dirs(self.config.trainer, run_dir(self.config.trainer), path, [self.processes])
        if path is None:
            return 0
        state = checkpointing.load_driver_state(path)
        self.workers.load_checkpoint(str(path))
        self.train_loader.sampler.load_state_dict(state["sampler"])
        return int(state["global_steps"])

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step=step)
        if self.console:
            shown = ("train/loss", "train/grad_norm", "train/lr", "val/loss", "timing_s/step", "perf/throughput")
            cells = "  ".join(f"{key}={metrics[key]:.4g}" for key in shown if key in metrics)
            logger.info("step %d/%d | %s", step, self.total_training_steps, cells)

    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
        if self.processes is not None:
            self.processes.shutdown()


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Run an SFT job from a checked config; returns the validation/training loss summary."""
    tokenizer = build_tokenizer(cfg.model)
    train_loader, val_loader = build_sft_dataloaders(cfg.data, tokenizer)
    # The console backend shows RL keys; SFT prints its own line per step (see SFTTrainer._log).
    tracking = build_tracking(cfg.trainer, cfg, [name for name in cfg.trainer.logger if name != "console"])
    if not cfg.trainer.local_mode:
        init_ray(cfg.ray_kwargs.ray_init, cfg.trainer.world_size)
    trainer = SFTTrainer(cfg, train_loader, val_loader, tracking, console="console" in cfg.trainer.logger)
    try:
        trainer.init_workers()
        summary = trainer.fit()
        logger.info("SFT done: %s", {key: round(value, 4) for key, value in summary.items()})
        return summary
    finally:
        write_ray_timeline(cfg.ray_kwargs.timeline_json_file)
        trainer.shutdown()
        tracking.finish()
