"""`RayPPOTrainer`: the driver loop of PPO/GRPO (the hybrid controller's single controller).

`train_step()` is the algorithm, one RPC per line, each under its timer: generate -> reward -> old log-prob
-> ref -> values -> advantages -> update critic -> update actor (-> weight sync to a split rollout pool). The
old-log-prob pass runs only when needed (`old_log_prob_source`): an exactly on-policy update takes them from its own forward, bypass mode from the rollout. Workers do the heavy work; the driver only
moves `DataProto` batches and computes advantages (pure torch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from hybridflow.algorithms import (
    build_kl_controller,
    compute_data_metrics,
    compute_rollout_probs_diff,
    compute_stage_throughput_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import RewardResult
from hybridflow.trainer import checkpointing
from hybridflow.trainer.advantage import apply_kl_in_reward, apply_pf_ppo, compute_advantage, variance_proxies
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.config.resume_checks import resumed_settings
from hybridflow.trainer.dynamic_sampling import GroupFilter, merge_generation_metrics
from hybridflow.trainer.generation import generate_batch
from hybridflow.trainer.rollout_replay import RolloutReplay, replay_name
from hybridflow.trainer.generation_dump import dump_generations, generation_rows
from hybridflow.trainer.guards import StepGuards, WeightVersionWatch, served_versions
from hybridflow.trainer.guards.memory import arm_within_step_watch
from hybridflow.trainer.reward_stage import RewardStage, build_reward_stage
from hybridflow.trainer.profiling import StepProfiling
from hybridflow.trainer.rollout_correction import apply_rollout_correction
from hybridflow.trainer.scaffold import due, heartbeat, progress_bar, run_dir, timer, total_steps, worker_metrics
from hybridflow.trainer.tracking import Tracking
from hybridflow.trainer.validation import run_validation
from hybridflow.trainer.worker_setup import WorkerGroups, build_generator, build_worker_groups
from hybridflow.workers.ppo_update import BYPASS_CORRECTION_KEY
from hybridflow.utils.seqlen_balancing import balanced_group_partitions, balanced_partitions, partition_stats

logger = logging.getLogger(__name__)


_OLD_LOG_PROB_SOURCES = {
    "recompute": "a separate actor forward before the update",
    "update": "the update's own forward (exactly on-policy: one epoch, one mini-batch per step), no separate pass",
    "rollout": "the rollout engine's log-probs (algorithm.rollout_correction.bypass_mode)",
}


class RayPPOTrainer:
    """Runs PPO-family algorithms over worker groups built from a `PPOConfig`."""

    on_policy_rollouts = True
    """Each step generates with the actor's latest weights (the off-policy trainers, which sample ahead, say False):
    the samples' `rollout_weight_version` must then advance after every update (`guards.versions`)."""

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
        self.use_critic = config.critic_enabled
        self.use_reference = config.uses_reference
        self.old_log_probs = config.old_log_prob_source
        self.kl_ctrl = build_kl_controller(**vars(config.algorithm.kl_ctrl))
        self.total_training_steps = total_steps(config.trainer, len(train_dataloader))
        self.global_steps = 0
        self.guards = StepGuards(config.trainer.guards)
        # A replayed rollout (skip_rollout) keeps the weight version it was generated with, by design.
        replays = config.actor_rollout_ref.rollout.skip_rollout
        self.weight_versions = WeightVersionWatch() if self.on_policy_rollouts and not replays else None
        self.initial_val_metrics: dict[str, float] = {}
        self.workers: WorkerGroups | None = None
        self.generator: Any = None  # the actor/rollout group, or the agent-loop manager in async mode
        self.rewards: RewardStage | None = None  # outcome scores (and PRIME's implicit PRM), with the workers
        self.profiling: StepProfiling | None = None  # global_profiler's steps, with the workers
        # Agent loops read every row field of the prompts they are sent.
        self.pass_rows = config.actor_rollout_ref.rollout.mode == "async"
        rollout, run = config.actor_rollout_ref.rollout, config.trainer
        self.replay = None  # rollout.skip_rollout's dump of the first training generation
        if rollout.skip_rollout:
            name = replay_name(run.project_name, run.experiment_name, config.data.train_batch_size, rollout.n)
            self.replay = RolloutReplay(rollout.skip_dump_dir, name)

    def init_workers(self) -> None:
        """Start the worker processes and load the models (before the first step)."""
        logger.info("old log-probs: %s", _OLD_LOG_PROB_SOURCES[self.old_log_probs])
        self.workers = build_worker_groups(self.config, self.total_training_steps)
        armed = arm_within_step_watch(self.workers.processes, self.config.trainer.guards.memory)
        logger.info("memory budget watched within steps in %d worker processes", armed)
        self.generator = build_generator(self.config, self.workers.generation, self.reward_fn.tokenizer)
        if self.config.generative_reward_model:  # the reward functions ask the served judge; no score of its own
            self.reward_fn.judge.attach(self.workers.reward_model)
            self.rewards = build_reward_stage(self.config, self.reward_fn, None)
        else:
            self.rewards = build_reward_stage(self.config, self.reward_fn, self.workers.reward_model)
        self.profiling = StepProfiling(self.config, self.workers.processes)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train until `total_training_steps`; returns the last validation metrics."""
        trainer_cfg = self.config.trainer
        self.global_steps = self._resume()
        val_metrics: dict[str, float] = {}
        # val_only validates the resumed checkpoint's policy too (at its step); val_before_train only a fresh one
        if self.val_dataloader is not None and (
            trainer_cfg.val_only or (trainer_cfg.val_before_train and self.global_steps == 0)
        ):
            val_metrics = self.validate()
            if self.global_steps == 0:
                self.initial_val_metrics = dict(val_metrics)
            self.tracking.log(val_metrics, step=self.global_steps)
        if trainer_cfg.val_only:
            return val_metrics
        if self.global_steps >= self.total_training_steps:
            logger.warning(
                "resumed at step %d of %d: this run is complete and nothing was trained; raise "
                "trainer.total_training_steps to go on, or set trainer.val_only=True to validate its checkpoint",
                self.global_steps, self.total_training_steps,
            )
        progress = progress_bar(self.total_training_steps, self.global_steps)
        batches = self._batches()
        profiling = self.profiling
        if profiling is not None:
            profiling.warn_unreached(self.total_training_steps)
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            is_last = self.global_steps >= self.total_training_steps
            metrics, timing = heartbeat(self.idle_processes(), trainer_cfg.heartbeat_timeout_s), {}
            if profiling is not None:
                profiling.begin(self.global_steps)
            with timer("step", timing):
                batch = self.train_step(batches, metrics, timing)
            curriculum_update = getattr(self.train_dataloader.sampler, "update", None)  # data.sampler's curriculum
            if curriculum_update is not None:
                curriculum_update(batch)
            if profiling is not None:
                metrics.update(profiling.end(self.global_steps, is_last))
            if self.val_dataloader is not None and due(trainer_cfg.test_freq, self.global_steps, is_last):
                with timer("testing", timing):
                    val_metrics = self.validate()
                metrics.update(val_metrics)
            saved = due(trainer_cfg.save_freq, self.global_steps, is_last)
            if saved:
                with timer("save_checkpoint", timing):
                    self.save_checkpoint()
            metrics.update(self._step_metrics(batch, timing))
            stop = self.check_guards(batch, metrics, saved)
            self.tracking.log(metrics, step=self.global_steps)
            progress.update(1)
            if stop is not None:  # raised after the step's checkpoint and metrics: the run resumes from this step
                raise stop
        progress.close()
        return val_metrics

    def check_guards(self, batch: DataProto, metrics: dict[str, float], saved: bool) -> RuntimeError | None:
        """The guards after a step (`trainer.guards`): alarms on its metrics, the workers' memory. When one must stop
        the run, this step's checkpoint is saved (if it was not already) and the error returned."""
        spent: dict[str, float] = {}
        with timer("guards", spent):
            stop = self.guards.check(self.global_steps, batch, metrics, self.idle_processes())
        metrics["timing_s/guards"] = spent["guards"]
        if stop is not None and not saved:
            self.save_checkpoint()
        return stop

    def idle_processes(self) -> list:
        """The worker processes that run no call between steps (the heartbeat pings them)."""
        return list(self.workers.processes)

    def train_step(self, batches: Iterator[dict], metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """One PPO step: the seed's dataflow, one RPC per stage. Prompts come from `batches` (dynamic sampling
        may draw several generation batches for one step)."""
        algo = self.config.algorithm
        actor_rollout, critic = self.workers.actor_rollout, self.workers.critic
        batch = self.sample(batches, metrics, timing)
        if self.weight_versions is not None:
            metrics.update(self.weight_versions.observe(self.global_steps, served_versions(batch)))
        if self.config.trainer.balance_batch:
            metrics.update(self._balance(batch))
        if self.old_log_probs == "recompute":
            with timer("old_log_prob", timing):
                batch = batch.union(self._collect(actor_rollout.compute_log_prob(batch), metrics))
            if "rollout_log_probs" in batch.batch.keys():
                metrics.update(compute_rollout_probs_diff(
                    batch.batch["rollout_log_probs"], batch.batch["old_log_probs"], batch.batch["response_mask"]
                ))
        elif self.old_log_probs == "rollout":  # bypass mode; "update": the update's own forward supplies them
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        if algo.rollout_correction.enabled and not algo.rollout_correction.bypass_mode:
            # importance weights and rejection, rollout vs trainer log-probs (bypass mode: inside the actor's loss)
            metrics.update(apply_rollout_correction(batch, algo.rollout_correction))
        if self.use_reference:
            with timer("ref", timing):
                batch = batch.union(self._collect(actor_rollout.compute_ref_log_prob(batch), metrics))
        if self.use_critic:
            with timer("values", timing):
                batch = batch.union(self._collect(critic.compute_values(batch), metrics))
        extra_inputs = self.rewards.process_rewards(batch, metrics, timing)  # PRIME: the implicit PRM's rewards
        with timer("adv", timing):
            if algo.use_kl_in_reward:
                metrics.update(apply_kl_in_reward(batch, self.kl_ctrl, algo.kl_penalty))
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = compute_advantage(
                batch, algo.adv_estimator, algo.gamma, algo.lam, algo.norm_adv_by_std_in_grpo, extra_inputs
            )
            if algo.use_pf_ppo:
                seed = self.config.trainer.seed * 1_000_003 + self.global_steps
                batch, pf_metrics = apply_pf_ppo(batch, algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow, seed)
                metrics.update(pf_metrics)
        if self.use_critic:
            with timer("update_critic", timing):
                self._collect(critic.update_critic(batch), metrics)
        if self.global_steps > self.config.trainer.critic_warmup:
            with timer("update_actor", timing):
                if algo.rollout_correction.in_loss:
                    batch.meta_info[BYPASS_CORRECTION_KEY] = dataclasses.asdict(algo.rollout_correction)
                self._collect(actor_rollout.update_actor(batch), metrics)
            if "sum_pi_squared" in batch.batch.keys():
                metrics.update(variance_proxies(batch, metrics.get("actor/grad_norm")))
            if self.weight_versions is not None:
                self.weight_versions.mark_update()
            self.sync_rollout_weights(metrics, timing)
        if self.config.trainer.rollout_data_dir is not None:
            scores = batch.batch["token_level_scores"].sum(-1).tolist()
            rows = generation_rows(batch, self.reward_fn.tokenizer, scores)
            dump_generations(self.config.trainer.rollout_data_dir, self.global_steps, rows)
        return batch

    def sync_rollout_weights(self, metrics: dict[str, float], timing: dict[str, float]) -> int | None:
        """Split placement: send the actor's new weights to the rollout pool (`timing_s/sync_rollout_weights`);
        returns the policy version (actor updates) the rollout pool now holds. Colocated, the rollout reads them in
        its own process before it generates: None."""
        if self.workers.weight_sync is None:
            return None
        with timer("sync_rollout_weights", timing):
            synced = self.workers.sync_rollout_weights()
        metrics.update(synced)
        return int(synced["sync_rollout_weights/policy_version"])

    # ------------------------------------------------------------------ experience: generate and score
    def sample(self, batches: Iterator[dict], metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """Scored rollouts for one step. DAPO's dynamic sampling (`algorithm.filter_groups`) keeps drawing
        generation batches until `data.train_batch_size` prompt groups disagree on its metric."""
        filter_groups = self.config.algorithm.filter_groups
        if not filter_groups.enable:
            batch, _ = self.generate_and_score(next(batches), metrics, timing)
            return batch
        groups = GroupFilter(
            filter_groups.metric, self.config.data.train_batch_size, self.config.actor_rollout_ref.rollout.n,
            filter_groups.max_num_gen_batches,
        )
        step_metrics: list[dict[str, float]] = []
        while not groups.full:
            step_metrics.append({})
            batch, extra_info = self.generate_and_score(next(batches), step_metrics[-1], timing)
            groups.add(batch, extra_info)
        batch, filter_metrics = groups.take()
        metrics.update(merge_generation_metrics(step_metrics))
        metrics.update(filter_metrics)
        return batch

    def generate_and_score(
        self, batch_dict: dict, metrics: dict[str, float], timing: dict[str, float]
    ) -> tuple[DataProto, dict[str, list]]:
        """Generate `rollout.n` responses per prompt and score them (`token_level_scores`); ReMax adds the greedy
        response's score as `reward_baselines`. Returns the batch and the reward manager's per-sample columns."""
        rollout = self.config.actor_rollout_ref.rollout
        generate = lambda: generate_batch(self.generator, batch_dict, rollout.n, pass_rows=self.pass_rows,  # noqa: E731
                                          validate=False)
        with timer("gen", timing):
            batch, gen_metrics = self.replay.generate(generate) if self.replay is not None else generate()
        metrics.update(gen_metrics)
        if self.config.estimator.greedy_baseline:
            with timer("gen_max", timing):
                greedy, _ = generate_batch(
                    self.generator, batch_dict, 1, pass_rows=self.pass_rows, validate=False,
                    overrides={"do_sample": False},
                )
            baseline = self.rewards.score(greedy, {}, timing).reward_tensor.sum(dim=-1)
            batch.batch["reward_baselines"] = baseline.repeat_interleave(rollout.n)
        reward = self.score_into(batch, metrics, timing)
        return batch, reward.extra_info

    def score_into(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> RewardResult:
        """Score `batch` and store its `token_level_scores` (the run's `RewardStage`)."""
        return self.rewards.score_into(batch, metrics, timing)

    def _balance(self, batch: DataProto) -> dict[str, float]:
        """Reorder `batch` in place so each data-parallel group's chunk holds about the same number of tokens (the
        actor's tensor/sequence-parallel peers share one chunk); verl's metrics."""
        actor = self.config.actor_rollout_ref.actor
        world = self.config.trainer.world_size // (
            actor.fsdp_config.tensor_parallel_size * actor.ulysses_sequence_parallel_size
        )
        lengths = batch.batch["attention_mask"].sum(-1).tolist()
        if self.config.actor_rollout_ref.actor.use_prefix_grouper:  # keep each prompt's samples on one rank
            partitions = balanced_group_partitions(lengths, batch.non_tensor_batch["uid"].tolist(), world)
            if partitions is None:  # groups that cannot be spread evenly stay in generation order (contiguous)
                return {}
        else:
            partitions = balanced_partitions(lengths, world)
        batch.reorder(torch.tensor([row for partition in partitions for row in partition]))
        return partition_stats(lengths, partitions, world)

    def _collect(self, output: DataProto, metrics: dict[str, float]) -> DataProto:
        """Move a worker result's metrics into `metrics`; return the result's data."""
        metrics.update(worker_metrics(output))
        return output

    def _batches(self) -> Iterator[dict]:
        """Generation batches from the current position on, epoch after epoch (resumable through the sampler)."""
        while True:
            empty = True
            for batch_dict in self.train_dataloader:
                empty = False
                yield batch_dict
            if empty:
                raise RuntimeError("the training data loader gave no batch in a whole epoch")

    def validate(self) -> dict[str, float]:
        """Validation metrics of the current policy over the whole validation set."""
        rollout = self.config.actor_rollout_ref.rollout
        return run_validation(
            self.generator,
            self.val_dataloader,
            self.val_reward_fn,
            n=rollout.val_kwargs.n,
            pass_rows=self.pass_rows,
            num_examples=self.config.trainer.log_val_generations,
            data_dir=self.config.trainer.validation_data_dir,
            step=self.global_steps,
        )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Checkpoint actor, critic and the driver's state (step, data position, KL coefficient) atomically."""
        def save_workers(staging: Path) -> None:  # each role saves its checkpoint.save_contents
            self.workers.actor_rollout.save_checkpoint(str(staging / "actor"))
            if self.workers.critic is not None:
                self.workers.critic.save_checkpoint(str(staging / "critic"))
            self.rewards.save_checkpoint(staging)

        state = {"sampler": self.data_position(), "kl_coef": float(self.kl_ctrl.value),
                 "settings": resumed_settings(self.config)}
        return checkpointing.save_checkpoint(
            run_dir(self.config.trainer), self.global_steps, save_workers, state,
            self.config.trainer.max_actor_ckpt_to_keep,
        )

    def data_position(self) -> dict[str, Any]:
        """The sampler state a resumed run continues from: after the last batch this run trained on."""
        return self.train_dataloader.sampler.state_dict()

    def _resume(self) -> int:
        """Load the checkpoint `trainer.resume_mode` picks into workers and driver; the step to continue from."""
        path = checkpointing.find_resume_dir(self.config.trainer, run_dir(self.config.trainer))
        checkpointing.check_shared_dirs(
            self.config.trainer, run_dir(self.config.trainer), path, self.workers.processes_besides_rollout()
        )
        if path is None:
            return 0
        state = checkpointing.load_driver_state(path)
        self.workers.actor_rollout.load_checkpoint(str(path / "actor"))
        self.sync_rollout_weights({}, {})
        if self.workers.critic is not None:
            self.workers.critic.load_checkpoint(str(path / "critic"))
        self.rewards.load_checkpoint(path)
        self.train_dataloader.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = state["kl_coef"]
        return int(state["global_steps"])

    def _step_metrics(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        tensors = dict(batch.batch.items())
        metrics = compute_data_metrics(tensors, use_critic=self.use_critic)
        metrics.update(compute_timing_metrics(tensors, timing))
        tokens = batch.batch["attention_mask"].sum(-1).tolist()
        metrics.update(compute_throughput_metrics(tokens, timing, self.config.trainer.world_size))
        metrics.update(compute_stage_throughput_metrics(tensors, timing))
        metrics["training/global_step"] = self.global_steps
        return metrics
