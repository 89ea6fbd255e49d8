"""`SFTTrainer`: the driver loop of supervised fine-tuning, and `run_sft` which assembles a run from a config.

    for batch in dataloader:
        metrics = workers.train_step(batch)       # one optimizer step over all ranks
        every test_freq steps: workers.eval_loss  # token-mean NLL over the validation set
        every save_freq steps: workers.save_checkpoint(global_step_N)

Checkpoints are `{trainer.default_local_dir}/global_step_N/` (engine shards, `huggingface/`, `lora_adapter/`
for LoRA, `driver_state.pt`), written atomically; `hybridflow merge --local_dir .../global_step_N` exports one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from hybridflow.data import build_sampler
from hybridflow.data.sft_dataset import SFTDataset, SFTDatasetConfig
from hybridflow.models import MODEL_CATALOGUE, catalogue_tokenizer_path, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridflow.trainer import checkpoint_dirs
from hybridflow.trainer.run import init_ray
from hybridflow.trainer.sft.config import SFTConfig
from hybridflow.trainer.sft.worker import SFTRuntime, SFTWorker
from hybridflow.trainer.tracking import Tracking
from hybridflow.utils.device import device_count

logger = logging.getLogger(__name__)

DRIVER_STATE = "driver_state.pt"


def build_sft_dataset(cfg: SFTConfig, files: list[str], tokenizer: Any) -> SFTDataset:
    """The dataset of `files` with the `data.*` settings."""
    data = cfg.data
    config = SFTDatasetConfig(
        prompt_key=data.prompt_key,
        response_key=data.response_key,
        prompt_dict_keys=tuple(data.prompt_dict_keys),
        response_dict_keys=tuple(data.response_dict_keys),
        multiturn=data.multiturn.enable,
        messages_key=data.multiturn.messages_key,
        tools_key=data.multiturn.tools_key,
        max_length=data.max_length,
        truncation=data.truncation,
        apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs),
    )
    return SFTDataset(files, tokenizer, config)


def build_sft_dataloaders(cfg: SFTConfig, tokenizer: Any) -> tuple[DataLoader, DataLoader | None]:
    """Training loader (seeded, resumable sampler, full batches only) and validation loader."""
    train_set = build_sft_dataset(cfg, list(cfg.data.train_files), tokenizer)
    batch_size = cfg.data.train_batch_size
    if len(train_set) < batch_size:
        raise ValueError(f"data.train_batch_size={batch_size} is larger than the {len(train_set)} training samples")
    train_loader = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=build_sampler(train_set, shuffle=cfg.data.shuffle, seed=cfg.data.seed),
        collate_fn=train_set.collate,
        drop_last=True,
        num_workers=0,  # keeps the sampler position exact for resume
    )
    if not cfg.data.val_files:
        return train_loader, None
    val_set = build_sft_dataset(cfg, list(cfg.data.val_files), tokenizer)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, collate_fn=val_set.collate, num_workers=0)
    return train_loader, val_loader


def build_sft_worker_group(cfg: SFTConfig, total_training_steps: int) -> tuple[Any, RayResourcePool | None]:
    """One SFTWorker per rank: in the driver (`trainer.local_mode`) or as Ray actors over gloo/nccl."""
    world = cfg.trainer.world_size
    threads = cfg.trainer.num_threads_per_worker
    use_gpu = device_count() > 0 and cfg.trainer.device != "cpu"
    if threads == 0 and not use_gpu:
        threads = max(1, (os.cpu_count() or 1) // world)  # share the cores among the CPU workers
    runtime = SFTRuntime(total_training_steps=total_training_steps, num_threads=threads)
    worker = RayClassWithInitArgs(SFTWorker, cfg, runtime)
    if cfg.trainer.local_mode:
        group, pool = LocalWorkerGroup(worker, world_size=1), None
    else:
        pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, use_gpu=use_gpu, name_prefix="sft")
        group = RayWorkerGroup(pool, worker, name_prefix="hybridflow_sft")
    group.init_model()
    return group, pool


class SFTTrainer:
    """Runs SFT over a worker group; see the module docstring for the loop."""

    def __init__(self, config: SFTConfig, train_loader: DataLoader, val_loader: DataLoader | None,
                 tracking: Tracking, console: bool = True) -> None:
        self.config = config
        self.train_loader, self.val_loader = train_loader, val_loader
        self.tracking, self.console = tracking, console
        total = len(train_loader) * config.trainer.total_epochs
        self.total_training_steps = min(total, config.trainer.total_training_steps or total)
        self.global_steps = 0
        self.workers: Any = None
        self.pool: RayResourcePool | None = None
        self.history: list[dict[str, float]] = []

    def init_workers(self) -> None:
        """Start the workers and load the model."""
        self.workers, self.pool = build_sft_worker_group(self.config, self.total_training_steps)

    def fit(self) -> dict[str, float]:
        """Train until `total_training_steps`; returns {'val/loss_before', 'val/loss', ...} where measured."""
        cfg = self.config.trainer
        self.global_steps = self._maybe_resume()
        summary: dict[str, float] = {}
        if self.val_loader is not None and cfg.val_before_train and self.global_steps == 0:
            summary["val/loss_before"] = self.validate()
            self._log({"val/loss": summary["val/loss_before"]}, step=0)
        while self.global_steps < self.total_training_steps:
            for batch in self.train_loader:
                self.global_steps += 1
                metrics = self.train_step(batch)
                is_last = self.global_steps >= self.total_training_steps
                if self.val_loader is not None and _due(cfg.test_freq, self.global_steps, is_last):
                    metrics["val/loss"] = summary["val/loss"] = self.validate()
                if _due(cfg.save_freq, self.global_steps, is_last):
                    self.save()
                self._log(metrics, step=self.global_steps)
                if is_last:
                    break
        summary["train/loss"] = self.history[-1]["train/loss"] if self.history else float("nan")
        return summary

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step; returns the step's metrics (loss averaged over ranks)."""
        start = time.perf_counter()
        output = self.workers.train_step(DataProto.from_single_dict(batch))
        elapsed = time.perf_counter() - start
        metrics = {key: sum(values) / len(values) for key, values in output.meta_info["metrics"].items()}
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
        return nll / max(tokens, 1.0)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint step `global_steps` atomically (staged, then renamed)."""
        cfg = self.config.trainer
        root = Path(cfg.default_local_dir).resolve()  # Ray workers may run in another directory
        staging = checkpoint_dirs.staging_dir(root, self.global_steps)
        self.workers.save_checkpoint(str(staging))
        state = {"global_steps": self.global_steps, "sampler": self.train_loader.sampler.state_dict()}
        torch.save(state, staging / DRIVER_STATE)
        final = checkpoint_dirs.commit_step(root, self.global_steps, staging, cfg.max_ckpt_to_keep)
        logger.info("saved checkpoint %s", final)
        return final

    def _maybe_resume(self) -> int:
        cfg = self.config.trainer
        if cfg.resume_mode == "disable":
            return 0
        if cfg.resume_mode == "resume_path":
            path = Path(cfg.resume_from_path).resolve()
            checkpoint_dirs.step_of(path)
        else:
            root = Path(cfg.default_local_dir).resolve()
            step = checkpoint_dirs.latest_step(root)
            if step is None:
                return 0
            path = checkpoint_dirs.step_dir(root, step)
        if not (path / DRIVER_STATE).is_file():
            raise FileNotFoundError(f"{path} holds no {DRIVER_STATE}: not a complete SFT checkpoint")
        state = torch.load(path / DRIVER_STATE, weights_only=False)
        self.workers.load_checkpoint(str(path))
        self.train_loader.sampler.load_state_dict(state["sampler"])
        logger.info("resumed from %s at step %d", path, state["global_steps"])
        return int(state["global_steps"])

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step=step)
        if self.console:
            shown = ("train/loss", "train/grad_norm", "train/lr", "val/loss", "timing_s/step", "perf/throughput")
            cells = "  ".join(f"{key}={metrics[key]:.4g}" for key in shown if key in metrics)
            logger.info("step %d/%d | %s", step, self.total_training_steps, cells)

    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
        if isinstance(self.workers, RayWorkerGroup):
            self.workers.shutdown()
        if self.pool is not None:
            self.pool.release()


def _due(freq: int, step: int, is_last: bool) -> bool:
    return is_last or (freq > 0 and step % freq == 0)


def build_sft_tokenizer(cfg: SFTConfig) -> Any:
    """The driver's tokenizer (catalogue models: tokenizer only, without converting the weights here)."""
    location = cfg.model.tokenizer_path or cfg.model.partial_pretrain
    if location in MODEL_CATALOGUE:
        return load_tokenizer(catalogue_tokenizer_path(location))
    return load_tokenizer(resolve_model_path(location))


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Run an SFT job from a checked config; returns the validation/training loss summary."""
    tokenizer = build_sft_tokenizer(cfg)
    train_loader, val_loader = build_sft_dataloaders(cfg, tokenizer)
    run_dir = Path(cfg.trainer.default_local_dir)
    # The console backend shows RL keys; SFT prints its own line per step (see SFTTrainer._log).
    backends = [name for name in cfg.trainer.logger if name != "console"]
    tracking = Tracking(backends, run_dir, cfg.trainer.project_name, cfg.trainer.experiment_name, asdict(cfg))
    if not cfg.trainer.local_mode:
        init_ray(cfg)
    trainer = SFTTrainer(cfg, train_loader, val_loader, tracking, console="console" in cfg.trainer.logger)
    try:
        trainer.init_workers()
        summary = trainer.fit()
        logger.info("SFT done: %s", {key: round(value, 4) for key, value in summary.items()})
        return summary
    finally:
        trainer.shutdown()
        tracking.finish()
