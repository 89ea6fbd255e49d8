"""One-step off-policy PPO/GRPO (verl's one-step-off-policy recipe): on split pools, the rollout generates batch
k+1 while the actor trains on batch k.

    rollout pool   gen 1 (v0) | gen 2 (v0)          | gen 3 (v1)          | ...
    trainer pool              | train 1 -> v1, sync | train 2 -> v2, sync | ...

Batch k+1 is generated with the weights from before update k (version v_{k-1}) and trained on after update k,
so every sample is exactly one policy version stale (the first batch: zero). Each sample records it
(`staleness`, and `rollout_policy_version`, both (bs,) int64), logged as `rollout/staleness/{mean,min,max}`.
Off-policy correction is the usual machinery: the old-log-prob pass gives the proximal policy's log-probs and
`algorithm.rollout_correction` weights or rejects samples against the rollout's log-probs.

Every worker-group call is made from the driver's thread, in order: the next generation is submitted (a
non-blocking `generate_sequences_async`) before this step's weight sync, so the rollout ranks run them in that
order and the sync waits for the generation to end. A checkpoint records the data position before the batch in
flight; a resumed run generates that batch again with the restored weights (staleness 0 for that step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.generation import build_prompts, join_responses
from hybridflow.trainer.placement import is_split
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import timer


def check_off_policy_trainer(cfg: PPOConfig, trainer: str, extra: list[tuple[bool, str, str]] = ()) -> None:
    """What an off-policy trainer (`trainer`, e.g. 'one-step off-policy') needs: split pools, one generation per
    step, batch generation; `extra` adds (refused, key, reason) rows."""
    if not is_split(cfg):
        raise ValueError(
            f"the {trainer} trainer generates on the rollout pool while the trainer pool trains: set "
            "actor_rollout_ref.hybrid_engine=False (and rollout.nnodes / rollout.n_gpus_per_node)"
        )
    refusals = [
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=True",
         "dynamic sampling draws a variable number of generation batches per step"),
        (cfg.algorithm.adv_estimator == "remax", "algorithm.adv_estimator='remax'",
         "ReMax's greedy baseline is a second generation of the same batch"),
        (cfg.actor_rollout_ref.rollout.mode == "async", "actor_rollout_ref.rollout.mode=async",
         "agent loops cannot yet be left running across a weight sync"),
        *extra,
    ]
    for refused, key, reason in refusals:
        if refused:
            raise ValueError(f"{key} is not supported by the {trainer} trainer: {reason}; use `hybridflow train`")


def check_one_step_off_policy(cfg: PPOConfig) -> None:
    """What the one-step off-policy trainer needs (`check_off_policy_trainer`)."""
    check_off_policy_trainer(cfg, "one-step off-policy")


@dataclass
class _Generation:
    """A generation in flight: the prompt rows, the rollout's future output and the weights' version."""

    batch: DataProto
    output: DataProtoFuture
    policy_version: int
    data_position: dict[str, Any]
    """The sampler state before this batch was drawn (where a resumed run starts again)."""


class OneStepOffPolicyTrainer(RayPPOTrainer):
    """`RayPPOTrainer` whose experience stage returns the batch generated during the previous step and starts the
    next one; the rest of the step (log-probs, advantages, updates, weight sync) is the same."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: _Generation | None = None
        self._rollout_version = 0  # the version the rollout pool holds: the actor's at the last sync

    def sample(self, batches, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """This step's scored batch (generated while the previous step trained); starts the next generation."""
        current = self._in_flight or self._launch(batches)
        more = self.global_steps < self.total_training_steps
        self._in_flight = self._launch(batches) if more else None
        with timer("gen", timing):  # only the part of the generation that training did not hide
            output = current.output.get()
        batch, gen_metrics = join_responses(current.batch, output)
        metrics.update(gen_metrics)
        staleness = self._rollout_version - current.policy_version
        batch.batch["rollout_policy_version"] = torch.full((len(batch),), current.policy_version, dtype=torch.int64)
        batch.batch["staleness"] = torch.full((len(batch),), staleness, dtype=torch.int64)
        values = batch.batch["staleness"].float()
        metrics.update({
            "rollout/staleness/mean": float(values.mean()),
            "rollout/staleness/min": float(values.min()),
            "rollout/staleness/max": float(values.max()),
        })
        self.score_into(batch, metrics, timing)
        return batch

    def _launch(self, batches) -> _Generation:
        """Draw the next prompts and submit their generation to the rollout pool (returns at once)."""
        position = self.train_dataloader.sampler.state_dict()
        rollout = self.config.actor_rollout_ref.rollout
        batch, prompts = build_prompts(next(batches), rollout.n, pass_rows=self.pass_rows, validate=False)
        output = self.workers.rollout.generate_sequences_async(prompts)
        return _Generation(batch, output, self._rollout_version, position)

    def sync_rollout_weights(self, metrics: dict[str, float], timing: dict[str, float]) -> None:
        """The weight sync, remembering the version the rollout now holds."""
        synced: dict[str, float] = {}
        super().sync_rollout_weights(synced, timing)
        metrics.update(synced)
        self._rollout_version = int(synced["sync_rollout_weights/policy_version"])

    def idle_processes(self) -> list:
        """Not the rollout pool while it generates the next batch: a ping would queue behind that call."""
        if self._in_flight is None:
            return super().idle_processes()
        return self.workers.processes_besides_rollout()

    def data_position(self) -> dict[str, Any]:
        """Before the batch in flight, which no update has used yet."""
        if self._in_flight is not None:
            return self._in_flight.data_position
        return super().data_position()
