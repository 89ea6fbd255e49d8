"""`RayPPOTrainer`: the driver loop of PPO/GRPO (the hybrid controller's single controller).

`fit()` reads like the algorithm: generate -> reward -> old log-prob -> ref -> values -> advantages ->
update critic -> update actor, every stage timed. Workers do the heavy work; the driver only moves
`DataProto` batches and computes advantages (pure torch).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from hybridflow.algorithms import (
    build_kl_controller,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    masked_mean,
)
from hybridflow.protocol import DataProto
from hybridflow.trainer import checkpointing
from hybridflow.trainer.advantage import apply_kl_in_reward, compute_advantage
from hybridflow.trainer.config import PPOConfig, critic_enabled, uses_reference
from hybridflow.trainer.tracking import Tracking
from hybridflow.trainer.validation import run_validation
from hybridflow.trainer.worker_setup import (
    PROMPT_KEYS,
    WorkerGroups,
    build_generator,
    build_worker_groups,
    rollout_inputs,
)

logger = logging.getLogger(__name__)



@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to `timing[name]` (seconds)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


class RayPPOTrainer:
    """Runs PPO-family algorithms over worker groups built from a `PPOConfig`."""

    def __init__(
        self,
        config: PPOConfig,
        train_dataloader: DataLoader,
        val_dataloader: DataLoader | None,
        reward_fn: Any,
        val_reward_fn: Any,
        tracking: Tracking,
    ) -> None:
        self.config = config
        self.train_dataloader, self.val_dataloader = train_dataloader, val_dataloader
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.tracking = tracking
        self.use_critic = critic_enabled(config)
        self.use_reference = uses_reference(config)
        self.kl_ctrl = build_kl_controller(**vars(config.algorithm.kl_ctrl))
        steps_per_epoch = len(train_dataloader)
        total = steps_per_epoch * config.trainer.total_epochs
        self.total_training_steps = min(total, config.trainer.total_training_steps or total)
        self.global_steps = 0
        self.initial_val_metrics: dict[str, float] = {}
        self.workers: WorkerGroups | None = None
        self.generator: Any = None  # the actor/rollout group, or the agent-loop manager in async mode

    def init_workers(self) -> None:
        """Start the worker processes and load the models (before the first step)."""
        self.workers = build_worker_groups(self.config, self.total_training_steps)
        self.generator = build_generator(self.config, self.workers.actor_rollout, self.reward_fn.tokenizer)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train until `total_training_steps`; returns the last validation metrics."""
        trainer_cfg = self.config.trainer
        self.global_steps = checkpointing.maybe_resume(self)
        val_metrics: dict[str, float] = {}
        wants_val = trainer_cfg.val_before_train or trainer_cfg.val_only
        if self.val_dataloader is not None and wants_val and self.global_steps == 0:
            val_metrics = self._validate()
            self.initial_val_metrics = dict(val_metrics)
            self.tracking.log(val_metrics, step=0)
        if trainer_cfg.val_only:
            return val_metrics
        progress = _progress(self.total_training_steps, self.global_steps)
        for batch_dict in self._batches():
            self.global_steps += 1
            metrics, timing = {}, {}
            with timer("step", timing):
                batch = self._generate(batch_dict, timing, metrics)
                batch = self._compute_reward(batch, timing, metrics)
                batch = self._prepare_experience(batch, timing, metrics)
                self._train(batch, timing, metrics)
            is_last = self.global_steps >= self.total_training_steps
            if self._due(trainer_cfg.test_freq, is_last) and self.val_dataloader is not None:
                with timer("testing", timing):
                    val_metrics = self._validate()
                metrics.update(val_metrics)
            if self._due(trainer_cfg.save_freq, is_last):
                with timer("save_checkpoint", timing):
                    checkpointing.save(self)
            metrics.update(self._step_metrics(batch, timing))
            self.tracking.log(metrics, step=self.global_steps)
            progress.update(1)
            if is_last:
                break
        progress.close()
        return val_metrics

    def _batches(self) -> Iterator[dict]:
        """Training batches from the current position on (resumable through the sampler)."""
        while self.global_steps < self.total_training_steps:
            for batch_dict in self.train_dataloader:
                yield batch_dict

    def _due(self, freq: int, is_last: bool) -> bool:
        return is_last or (freq > 0 and self.global_steps % freq == 0)

    # ------------------------------------------------------------------ stages
    def _generate(self, batch_dict: dict, timing: dict[str, float], metrics: dict[str, float]) -> DataProto:
        """Stage 1: `rollout.n` responses per prompt; each prompt's samples share a uid."""
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True)
        prompts = rollout_inputs(batch, self.config)
        with timer("gen", timing):
            output = self.generator.generate_sequences(prompts)
        worker_timing = _mean_worker_metrics(output)
        output.meta_info.pop("metrics", None)
        timing["update_weights"] = worker_timing.pop("timing_s/update_weights", 0.0)
        metrics.update({key: value for key, value in worker_timing.items() if not key.startswith("timing_s/")})
        batch.pop(batch_keys=list(PROMPT_KEYS))
        return batch.union(output)

    def _compute_reward(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> DataProto:
        """Stage 2a: rule/model scores placed on each response's last token."""
        with timer("reward", timing):
            result = self.reward_fn(batch, return_dict=True)
        batch.batch["token_level_scores"] = result["reward_tensor"]
        metrics.update(result.get("reward_metrics", {}))
        return batch

    def _prepare_experience(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> DataProto:
        """Stage 2b: old/ref log-probs, values, KL-in-reward, advantages (on the driver)."""
        groups = self.workers
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        with timer("old_log_prob", timing):
            old = groups.actor_rollout.compute_log_prob(batch)
        old.meta_info.pop("metrics", None)
        entropys = old.batch.pop("entropys")
        metrics["actor/entropy"] = float(masked_mean(entropys, batch.batch["response_mask"]))
        batch = batch.union(old)
        if self.use_reference:
            with timer("ref", timing):
                batch = batch.union(groups.actor_rollout.compute_ref_log_prob(batch))
        if self.use_critic:
            with timer("values", timing):
                batch = batch.union(groups.critic.compute_values(batch))
        with timer("adv", timing):
            algo = self.config.algorithm
            if algo.use_kl_in_reward:
                metrics.update(apply_kl_in_reward(batch, self.kl_ctrl, algo.kl_penalty))
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = compute_advantage(batch, algo.adv_estimator, algo.gamma, algo.lam, algo.norm_adv_by_std_in_grpo)
        return batch

    def _train(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> None:
        """Stage 3: critic update, then (after warm-up) actor update."""
        if self.use_critic:
            with timer("update_critic", timing):
                output = self.workers.critic.update_critic(batch)
            metrics.update(_mean_worker_metrics(output))
        if self.global_steps > self.config.trainer.critic_warmup:
            with timer("update_actor", timing):
                output = self.workers.actor_rollout.update_actor(batch)
            metrics.update(_mean_worker_metrics(output))

    def _validate(self) -> dict[str, float]:
        return run_validation(self)

    def _step_metrics(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        tensors = dict(batch.batch.items())
        metrics = compute_data_metrics(tensors, use_critic=self.use_critic)
        metrics.update(compute_timing_metrics(tensors, timing))
        tokens = batch.batch["attention_mask"].sum(-1).tolist()
        world = self.config.trainer.nnodes * self.config.trainer.n_gpus_per_node
        metrics.update(compute_throughput_metrics(tokens, timing, world))
        metrics["training/global_step"] = self.global_steps
        return metrics


def _mean_worker_metrics(output: DataProto) -> dict[str, float]:
    """Worker metrics arrive as per-rank lists (DataProto.concat); log their mean."""
    merged = output.meta_info.get("metrics", {})
    return {key: float(np.mean(value)) for key, value in merged.items()}


def _progress(total: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="training steps", unit="step", dynamic_ncols=True)
