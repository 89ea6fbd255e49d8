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

from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.generation import join_responses
from hybridflow.trainer.guards.versions import check_served_version, served_versions
from hybridflow.trainer.off_policy.generation import Generation, draw_generation, tag_staleness
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import timer


class OneStepOffPolicyTrainer(RayPPOTrainer):
    """`RayPPOTrainer` whose experience stage returns the batch generated during the previous step and starts the
    next one; the rest of the step (log-probs, advantages, updates, weight sync) is the same."""

    on_policy_rollouts = False  # samples come from the previous versions: staleness is tagged instead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: Generation | None = None
        self._rollout_version = 0  # the version the rollout pool holds: the actor's at the last sync

    def sample(self, batches, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """This step's scored batch (generated while the previous step trained); starts the next generation."""
        current = self._in_flight or self._launch(batches, self.global_steps)
        more = self.global_steps < self.total_training_steps
        self._in_flight = self._launch(batches, self.global_steps + 1) if more else None
        with timer("gen", timing):  # only the part of the generation that training did not hide
            output = current.rollout.get()
        batch, gen_metrics = join_responses(current.batch, output)
        metrics.update(gen_metrics)
        size, version = len(batch), current.policy_version
        check_served_version(f"step {self.global_steps}", served_versions(batch), version)
        metrics.update(tag_staleness(
            batch, torch.full((size,), self._rollout_version - version, dtype=torch.int64),
            {"rollout_policy_version": torch.full((size,), version, dtype=torch.int64)},
        ))
        self.score_into(batch, metrics, timing)
        return batch

    def _launch(self, batches, step: int) -> Generation:
        """Draw the prompts of `step` and submit their generation to the rollout pool (returns at once)."""
        generation, prompts = draw_generation(
            step, batches, self.train_dataloader.sampler, self.config.actor_rollout_ref.rollout.n,
            pass_rows=self.pass_rows, policy_version=self._rollout_version,
        )
        generation.rollout = self.workers.rollout.generate_sequences_async(prompts)
        return generation

    def sync_rollout_weights(self, metrics: dict[str, float], timing: dict[str, float]) -> int | None:
        """The weight sync, remembering the version the rollout now holds."""
        version = super().sync_rollout_weights(metrics, timing)
        self._rollout_version = version
        return version

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
