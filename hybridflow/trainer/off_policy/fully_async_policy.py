"""Fully asynchronous PPO/GRPO (verl's experimental fully_async_policy): on split pools a rollouter streams generated
batches into a bounded Ray queue while the trainer consumes them, one step each; with partial rollout a generation
in flight at a weight sync is paused and resumed under the new weights.

Design. The rollouter is a background thread of the driver (not a Ray actor): it draws a prompt batch
(data.train_batch_size prompts), has the rollout pool generate rollout.n samples per prompt, tags every token with
the policy version that sampled it, and puts the batch, unscored, into a `ray.util.queue.Queue`. The trainer thread
(`fit`) takes one item per step, scores it and runs the usual step (`RayPPOTrainer.train_step`): log-probs,
advantages, updates, and every `async_training.trigger_parameter_sync_step` steps (and after the last) a weight
sync. A thread is the simplest correct choice: both threads share the driver's worker-group handles, and two locks
order every call.

- Generation is a sequence of chunks (`partial_rollout.py`): with `async_training.partial_rollout` each call
  generates at most `partial_rollout_chunk_tokens` new tokens and unfinished responses are continued by the next
  call; without it a batch is one call. `gate.rollout_lock` serializes the calls to the rollout pool: a chunk, a weight
  sync (whose receiving side runs on the rollout ranks) and validation each hold it for their whole call. A sync
  announces itself (`gate.sync_pending`) so the rollouter pauses before its next chunk: the sync waits for one chunk,
  and the batch in flight resumes under the new weights (its KV cache recomputed by the chunk's prefill).
- `gate` (a `VersionGate`, `rollouter.py`) holds the policy version (`param_version`, verl's name: syncs done in
  this run) and the data positions of the drawn but untrained batches. Before drawing the batch of step s, the
  rollouter waits until s is at most `gate.lead` = floor((1 + staleness_threshold) x trigger_parameter_sync_step)
  steps past the last step whose weights the rollout holds (verl's bound, in whole batches). Every token of the
  batch is sampled at that version or later, so a sample's staleness, counted from its OLDEST token (versions
  between the weights that sampled its first token and the rollout's weights when it is trained on), is at most
  `gate.max_staleness` = ceil(lead / trigger) - 1 (the threshold, for whole thresholds); with a lead of one sync
  window the run is synchronous (each batch is generated after the previous step's sync: the same samples and metrics as
  `hybridflow train` on the same split pools with trigger_parameter_sync_step=1).

Nothing is dropped: the gate holds the bound, so no sample is ever too stale (`fully_async/num_dropped_samples`
is logged and stays 0; a sample over the bound would be an internal error). Per token the batch holds
`token_param_versions` and `token_policy_versions` ((bs, response_len) int64, -1 on padding; syncs and actor
updates of the weights that sampled it) and `rollout_log_probs` from those weights, so token-level rollout
correction (`algorithm.rollout_correction`) weighs each token against its own behaviour policy. Per sample:
`rollout_param_version` and `rollout_policy_version` (its oldest token's) and `staleness` (param versions), logged
as `rollout/staleness/*`; `fully_async/token_staleness/{mean,max}` and verl's `fully_async/partial/*` count the
tokens' versions. Also `fully_async/queue_size`, `fully_async/param_version` and timings: `timing_s/gen` (the
trainer waiting for samples), `fully_async/rollout_gen_s` (the batch's generation calls),
`fully_async/rollouter_wait_s` (its wait at the staleness gate).

The rollouter is a `ThreadedRollouter`; `async_training.deterministic_schedule_seed` replaces it by a
`ScheduledRollouter` that runs an `AsyncSchedule` in the driver's thread (for tests: the interleaving of chunks,
trains and syncs is fixed by the seed). Multi-turn agent loops are refused; verl's rollout.mode=async with single-turn
rows runs as batch generation (`checks.single_turn_batch_generation`). A checkpoint records the
data position before the oldest drawn but untrained batch; a resumed run generates those batches again.
"""

from __future__ import annotations

import functools
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.trainer.generation import join_responses
from hybridflow.trainer.off_policy.generation import Generation, draw_generation, tag_staleness
from hybridflow.trainer.off_policy.partial_rollout import PartialRollout, compute_version_metrics
from hybridflow.trainer.off_policy.rollouter import (
    Rollouter,
    ScheduledRollouter,
    ThreadedRollouter,
    VersionGate,
)
from hybridflow.trainer.off_policy.schedule import AsyncSchedule
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import timer


class FullyAsyncTrainer(RayPPOTrainer):
    """`RayPPOTrainer` fed by a rollouter (a thread, or a seeded schedule) through a bounded queue under a staleness
    bound; weight syncs every `async_training.trigger_parameter_sync_step` steps. See the module docstring."""

    on_policy_rollouts = False  # samples come from the previous versions: staleness is tagged instead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        async_cfg = self.config.async_training
        self.gate = VersionGate(async_cfg.staleness_threshold, async_cfg.trigger_parameter_sync_step)
        self.capacity = self.gate.lead  # batches drawn ahead, at most
        # Without partial rollout a batch is one call: its chunk is the whole response.
        self.chunk_tokens = self.config.actor_rollout_ref.rollout.response_length
        if async_cfg.partial_rollout:
            self.chunk_tokens = async_cfg.partial_rollout_chunk_tokens
        self.rollouter: Rollouter | None = None

    def build_schedule(self, seed: int) -> AsyncSchedule:
        """The schedule of a deterministic run (tests override it to script the events)."""
        return AsyncSchedule(seed=seed)

    def build_rollouter(self, batches) -> Rollouter:
        """A `ThreadedRollouter`, or with `async_training.deterministic_schedule_seed` a `ScheduledRollouter`."""
        args = (self.gate, functools.partial(self._draw, batches), self.workers.rollout.generate_sequences,
                self.total_training_steps, self.capacity)
        seed = self.config.async_training.deterministic_schedule_seed
        if seed is None:
            return ThreadedRollouter(*args)
        return ScheduledRollouter(*args, schedule=self.build_schedule(seed))

    def _draw(self, batches, step: int, policy_version: int) -> Generation:
        """The prompts of `step`, to be generated in chunks of `chunk_tokens`."""
        rollout, tokenizer = self.config.actor_rollout_ref.rollout, self.reward_fn.tokenizer
        generation, prompts = draw_generation(
            step, batches, self.train_dataloader.sampler, rollout.n, pass_rows=self.pass_rows,
            policy_version=policy_version,
        )
        generation.rollout = PartialRollout(
            prompts, rollout.response_length, self.chunk_tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id
        )
        return generation

    # ------------------------------------------------------------------ the trainer side
    def fit(self) -> dict[str, float]:
        """`RayPPOTrainer.fit`, stopping the rollouter however it ends."""
        try:
            return super().fit()
        finally:
            if self.rollouter is not None:
                self.rollouter.stop()

    def sample(self, batches, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """This step's batch from the rollouter (starting it on the first call), scored."""
        if self.rollouter is None:
            self.rollouter = self.build_rollouter(batches)
            self.rollouter.start(self.global_steps - 1)  # sample() runs inside the first step
        with timer("gen", timing):  # only the wait that the rollouter's lead did not hide
            generation = self.rollouter.take()
        assert generation.step == self.global_steps, (generation.step, self.global_steps)
        with self.gate.cond:
            self.gate.positions.popleft()
        batch, gen_metrics = join_responses(generation.batch, generation.output)
        metrics.update(gen_metrics)
        metrics.update(self._tag_versions(batch))
        metrics.update({
            "fully_async/queue_size": float(self.rollouter.queue_size()),
            "fully_async/param_version": float(self.gate.param_version),
            "fully_async/num_dropped_samples": 0.0,
            "fully_async/rollout_gen_s": generation.gen_s,
            "fully_async/rollouter_wait_s": generation.wait_s,
        })
        self.score_into(batch, metrics, timing)
        return batch

    def _tag_versions(self, batch: DataProto) -> dict[str, float]:
        """Per-sample version columns (the oldest token's: every row's first token is from the batch's first
        chunk) and the staleness and partial-rollout metrics."""
        tokens, param_version = batch.batch["token_param_versions"], self.gate.param_version
        assert bool((tokens[:, 0] >= 0).all()), "every response has a first token"
        oldest = tokens[:, 0]
        staleness = param_version - oldest
        within = (staleness >= 0) & (staleness <= self.gate.max_staleness)
        assert bool(within.all()), (staleness, param_version)
        metrics = tag_staleness(batch, staleness, {
            "rollout_param_version": oldest.clone(),
            "rollout_policy_version": batch.batch["token_policy_versions"][:, 0].clone(),
        })
        return {**metrics, **compute_version_metrics(tokens, batch.batch["response_mask"], param_version)}

    def sync_rollout_weights(self, metrics: dict[str, float], timing: dict[str, float]) -> int | None:
        """Every `trigger_parameter_sync_step` steps and after the last: pause the rollouter before its next chunk,
        sync, and open its gate one version further. (Before the rollouter starts, e.g. on resume, a plain sync
        that counts no version.)"""
        if self.rollouter is None:
            version = super().sync_rollout_weights(metrics, timing)
            self.gate.policy_version = self.gate.policy_version if version is None else version
            return version
        last = self.global_steps >= self.total_training_steps
        if self.global_steps % self.gate.sync_every != 0 and not last:
            return None
        synced: dict[str, float] = {}
        self.gate.sync(lambda: super(FullyAsyncTrainer, self).sync_rollout_weights(synced, timing))
        metrics.update(synced)
        return self.gate.policy_version

    def validate(self) -> dict[str, float]:
        """Validation on the rollout pool, between two of the rollouter's chunks."""
        with self.gate.rollout_lock:
            return super().validate()

    def idle_processes(self) -> list:
        """Not the rollout pool once the rollouter thread runs: a ping would queue behind its generation."""
        if not isinstance(self.rollouter, ThreadedRollouter):
            return super().idle_processes()
        return self.workers.processes_besides_rollout()

    def data_position(self) -> dict[str, Any]:
        """Before the oldest batch drawn but not yet trained on."""
        with self.gate.cond:
            if self.gate.positions:
                return self.gate.positions[0]
            return super().data_position()
