"""The sections of split placement and the off-policy trainers: the rollout's own pool (`rollout.*`) and the fully
async trainer (`async_training.*`), with verl's fully async rollouter keys that `hybridflow train-fully-async` maps
onto the trainer's (`off_policy/checks.verl_fully_async_keys`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridflow.utils.config import check_at_least, check_positive

__all__ = ["AsyncTrainingConfig", "RolloutPoolConfig"]


@dataclass(frozen=True, kw_only=True)
class RolloutPoolConfig:
    """The rollout's own resource pool under split placement (`rollout.*`, verl's one-step-off-policy keys)."""

    nnodes: int = 1
    """Nodes of the rollout pool (used with actor_rollout_ref.hybrid_engine=False)."""
    n_gpus_per_node: int = 1
    """Rollout processes per node: accelerators per node on GPU hosts, CPU workers on CPU hosts (used with
    actor_rollout_ref.hybrid_engine=False)."""
    total_rollout_steps: Optional[int] = None
    """verl's fully async rollouter: rollout steps to generate in all, each data.gen_batch_size prompts (one prompt
    when unset, as verl's fully async config sets it).
    `hybridflow train-fully-async` turns it into trainer.total_training_steps (those prompts over
    data.train_batch_size per step); other trainers refuse it."""
    total_epochs: Optional[int] = None
    """verl's fully async rollouter: passes over the data; train-fully-async sets trainer.total_epochs from it."""
    test_freq: Optional[int] = None
    """verl's fully async trainer: validate every N weight syncs; train-fully-async sets trainer.test_freq to N x
    async_training.trigger_parameter_sync_step steps."""

    def __post_init__(self) -> None:
        check_positive("nnodes", self.nnodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        for name in ("total_rollout_steps", "total_epochs", "test_freq"):
            check_positive(name, getattr(self, name), allow_none=True)

    @property
    def world_size(self) -> int:
        """Rollout ranks (nnodes x n_gpus_per_node)."""
        return self.nnodes * self.n_gpus_per_node


@dataclass(frozen=True, kw_only=True)
class AsyncTrainingConfig:
    """The fully asynchronous trainer (`async_training.*`, verl's fully_async_policy keys; read only by
    `hybridflow train-fully-async`). A trainer step consumes data.train_batch_size prompts x rollout.n samples
    (verl's require_batches x ppo_mini_batch_size); a policy version is one weight sync."""

    staleness_threshold: float = 1.0
    """How far the rollouter may run ahead of the rollout's weights (verl's key): at most (1 + staleness_threshold) x
    trigger_parameter_sync_step trainer steps' batches past the last sync, rounded down to whole batches (this
    trainer streams whole steps; verl streams prompts), then it waits for a sync. A sample then lags at most
    ceil(staleness_threshold) weight syncs behind the weights it is trained with; 0 (or a fraction that rounds to
    no extra batch) is synchronous training."""
    trigger_parameter_sync_step: int = 1
    """Trainer steps between weight syncs to the rollout pool (the last step also syncs)."""
    require_batches: int = 1
    """verl's mini-batches per trainer step: with verl's data.train_batch_size=0, a step trains on require_batches x
    actor.ppo_mini_batch_size prompts (data.train_batch_size is set to that); with a given data.train_batch_size
    the two must agree."""
    partial_rollout: bool = False
    """Pause generations in flight at a weight sync and resume them under the new weights (verl's key): the rollouter
    generates each batch in chunks of partial_rollout_chunk_tokens tokens and a sync may come between two chunks, so
    one response may hold tokens of several policy versions (recorded per token as `token_param_versions`, each token
    with the rollout log-prob of the weights that sampled it). A sync then waits for one chunk, not a whole batch.
    It only happens with staleness_threshold > 0 (at 0 no batch is in flight at a sync)."""
    partial_rollout_chunk_tokens: int = 64
    """With partial_rollout: most new tokens per generation call. Smaller chunks let a sync in sooner but prefill
    more often (a resumed response's prompt + prefix is prefilled again under the new weights). Must be below
    actor_rollout_ref.rollout.response_length."""
    deterministic_schedule_seed: Optional[int] = None
    """Testing: None runs the rollouter as a thread beside the trainer (real asynchrony). A seed runs both in the
    driver's one thread, interleaving chunk generations and training steps in an order drawn from the seed
    (`trainer/off_policy/schedule.py`), so the same seed reproduces a run's staleness and partial rollouts exactly."""

    def __post_init__(self) -> None:
        check_at_least("staleness_threshold", self.staleness_threshold, 0)
        check_positive("trigger_parameter_sync_step", self.trigger_parameter_sync_step)
        check_positive("require_batches", self.require_batches)
        check_positive("partial_rollout_chunk_tokens", self.partial_rollout_chunk_tokens)
