"""Fully asynchronous PPO/GRPO (verl's experimental fully_async_policy, without partial rollout): on split pools a
rollouter streams generated batches into a bounded Ray queue while the trainer consumes them, one step each.

Design. The rollouter is a background thread of the driver (not a Ray actor): it draws a prompt batch
(data.train_batch_size prompts), has the rollout pool generate rollout.n samples per prompt (one blocking
worker-group call), tags them with the policy version the rollout pool holds, and puts them, unscored, into a
`ray.util.queue.Queue`. The trainer thread (`fit`) takes one item per step, scores it and runs the usual step
(`RayPPOTrainer.train_step`): log-probs, advantages, updates, and every
`async_training.trigger_parameter_sync_step` steps (and after the last) a weight sync. A thread is the simplest
correct choice: both threads share the driver's worker-group handles, and two locks order every call.

- `_rollout_lock` serializes the calls to the rollout pool: a generation, a weight sync (whose receiving side runs
  on the rollout ranks) and validation each hold it for their whole call, so a sync is never issued while the
  rollout pool is mid-generation; it waits for the batch in flight to end. Ray actors run one method at a time
  anyway; the lock also keeps every rank's call order the same.
- `_gate` (a condition) holds the policy version (`param_version`, verl's name: syncs done in this run) and the
  data positions of the drawn but untrained batches. Before drawing the batch of step s, the rollouter waits
  until `syncs_before(s) - param_version <= staleness_threshold`, where `syncs_before(s)` is the number of syncs
  the trainer will have made when it trains step s. A sample's staleness (versions between the weights that
  generated it and the rollout's weights when it is trained on) is therefore at most the threshold; with 0 the
  run is synchronous (each batch is generated after the previous step's sync: the same samples and metrics as
  `hybridflow train` on the same split pools with trigger_parameter_sync_step=1).

Nothing is dropped: the gate holds the bound, so no sample is ever too stale (`fully_async/num_dropped_samples`
is logged and stays 0; a sample over the bound would be an internal error). Per sample the batch holds
`rollout_param_version` (syncs), `rollout_policy_version` (the actor updates in the weights that generated it,
as in the one-step off-policy trainer) and `staleness` (param versions), logged as `rollout/staleness/*`, with
`fully_async/queue_size`, `fully_async/param_version` and timings: `timing_s/gen` (the trainer waiting for
samples), `fully_async/rollout_gen_s` (the generation of the batch), `fully_async/rollouter_wait_s` (its wait at
the staleness gate). Off-policy data is corrected by `algorithm.rollout_correction`.

Partial rollout (pausing generations in flight across a sync) is not implemented and refused
(`async_training.partial_rollout`). A checkpoint records the data position before the oldest drawn but untrained
batch; a resumed run generates those batches again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.generation import build_prompts, join_responses
from hybridflow.trainer.one_step_off_policy import check_off_policy_trainer
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import timer

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often blocked queue calls look at the other thread's state (stop requests, errors)


def check_fully_async(cfg: PPOConfig) -> None:
    """What the fully async trainer needs: an off-policy trainer's (`check_off_policy_trainer`) and a fixed sync
    schedule."""
    check_off_policy_trainer(cfg, "fully async", [
        (cfg.trainer.critic_warmup > 0, f"trainer.critic_warmup={cfg.trainer.critic_warmup}",
         "the rollouter's staleness gate counts on a weight sync every trigger_parameter_sync_step steps; set it to 0"),
    ])


def syncs_before(step: int, start_step: int, sync_every: int) -> int:
    """Weight syncs a run that started after `start_step` has made when it trains `step` (1-based): one after each
    step that is a multiple of `sync_every`."""
    return (step - 1) // sync_every - start_step // sync_every


@dataclass
class _Generated:
    """One queue item: a generated (unscored) batch and the weights that generated it."""

    step: int
    batch: DataProto
    output: DataProto
    param_version: int
    policy_version: int
    gen_s: float
    wait_s: float


class FullyAsyncTrainer(RayPPOTrainer):
    """`RayPPOTrainer` fed by a rollouter thread through a bounded Ray queue under a staleness bound; weight syncs
    every `async_training.trigger_parameter_sync_step` steps. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        async_cfg = self.config.async_training
        self.staleness_threshold = int(async_cfg.staleness_threshold)
        self.sync_every = async_cfg.trigger_parameter_sync_step
        self._rollout_lock = threading.Lock()
        self._gate = threading.Condition()
        self._param_version = 0  # syncs made in this run (written under both locks)
        self._policy_version = 0  # actor updates in the rollout pool's weights
        self._positions: collections.deque = collections.deque()  # data positions of drawn, untrained batches
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._rollouter: threading.Thread | None = None
        self._queue: Any = None
        self._start_step = 0

    # ------------------------------------------------------------------ the trainer side
    def fit(self) -> dict[str, float]:
        """`RayPPOTrainer.fit`, stopping the rollouter however it ends."""
        try:
            return super().fit()
        finally:
            self._stop_rollouter()

    def sample(self, batches, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """This step's batch from the queue (starting the rollouter on the first call), scored."""
        if self._rollouter is None:
            self._start_rollouter(batches)
        with timer("gen", timing):  # only the wait that the rollouter's lead did not hide
            item = self._take()
        assert item.step == self.global_steps, (item.step, self.global_steps)
        with self._gate:
            self._positions.popleft()
        batch, gen_metrics = join_responses(item.batch, item.output)
        metrics.update(gen_metrics)
        staleness = self._param_version - item.param_version
        assert 0 <= staleness <= self.staleness_threshold, (staleness, self.staleness_threshold)
        size = len(batch)
        batch.batch["rollout_param_version"] = torch.full((size,), item.param_version, dtype=torch.int64)
        batch.batch["rollout_policy_version"] = torch.full((size,), item.policy_version, dtype=torch.int64)
        batch.batch["staleness"] = torch.full((size,), staleness, dtype=torch.int64)
        values = batch.batch["staleness"].float()
        metrics.update({
            "rollout/staleness/mean": float(values.mean()),
            "rollout/staleness/min": float(values.min()),
            "rollout/staleness/max": float(values.max()),
            "fully_async/queue_size": float(self._queue.qsize()),
            "fully_async/param_version": float(self._param_version),
            "fully_async/num_dropped_samples": 0.0,
            "fully_async/rollout_gen_s": item.gen_s,
            "fully_async/rollouter_wait_s": item.wait_s,
        })
        self.score_into(batch, metrics, timing)
        return batch

    def _take(self) -> _Generated:
        """The next queue item; raises the rollouter's error if it failed."""
        from ray.util.queue import Empty

        while True:
            if self._error is not None:
                raise RuntimeError("the rollouter thread failed") from self._error
            try:
                return self._queue.get(block=True, timeout=_POLL_S)
            except Empty:
                continue

    def sync_rollout_weights(self, metrics: dict[str, float], timing: dict[str, float]) -> None:
        """Every `trigger_parameter_sync_step` steps and after the last: wait for the generation in flight, sync,
        and open the rollouter's gate one version further. (Before the rollouter starts, e.g. on resume, a plain
        sync that counts no version.)"""
        if self._rollouter is None:
            super().sync_rollout_weights(metrics, timing)
            self._policy_version = int(metrics.get("sync_rollout_weights/policy_version", self._policy_version))
            return
        last = self.global_steps >= self.total_training_steps
        if self.global_steps % self.sync_every != 0 and not last:
            return
        synced: dict[str, float] = {}
        with self._rollout_lock:
            super().sync_rollout_weights(synced, timing)
            with self._gate:
                self._param_version += 1
                self._policy_version = int(synced["sync_rollout_weights/policy_version"])
                self._gate.notify_all()
        metrics.update(synced)

    def validate(self) -> dict[str, float]:
        """Validation on the rollout pool, between two of the rollouter's generations."""
        with self._rollout_lock:
            return super().validate()

    def idle_processes(self) -> list:
        """Not the rollout pool once the rollouter runs: a ping would queue behind its generation."""
        if self._rollouter is None:
            return super().idle_processes()
        return self.workers.processes_besides_rollout()

    def data_position(self) -> dict[str, Any]:
        """Before the oldest batch drawn but not yet trained on."""
        with self._gate:
            if self._positions:
                return self._positions[0]
            return super().data_position()

    # ------------------------------------------------------------------ the rollouter
    def _start_rollouter(self, batches) -> None:
        from ray.util.queue import Queue

        # The gate lets the rollouter run (1 + threshold) sync windows ahead of the trainer at most.
        # The queue's actor takes no CPU: the pools' placement groups may hold them all.
        self._queue = Queue(
            maxsize=(self.staleness_threshold + 1) * self.sync_every, actor_options={"num_cpus": 0}
        )
        self._start_step = self.global_steps - 1  # sample() runs inside the first step
        self._rollouter = threading.Thread(target=self._produce, args=(batches,), name="rollouter", daemon=True)
        self._rollouter.start()

    def _stop_rollouter(self) -> None:
        if self._rollouter is None:
            return
        self._stop.set()
        with self._gate:
            self._gate.notify_all()
        self._rollouter.join()
        self._queue.shutdown()

    def _produce(self, batches) -> None:
        """The rollouter thread: one generated batch per remaining step, in step order."""
        try:
            for step in range(self._start_step + 1, self.total_training_steps + 1):
                item = self._generate(step, batches)
                if item is None or not self._put(item):
                    return
        except BaseException as error:  # handed to the trainer thread, which raises it with context
            logger.error("the rollouter failed: %r", error)
            self._error = error

    def _generate(self, step: int, batches) -> _Generated | None:
        """Wait at the staleness gate, draw the prompts of `step` and generate them (None when stopped)."""
        needed = syncs_before(step, self._start_step, self.sync_every) - self.staleness_threshold
        start = time.perf_counter()
        with self._gate:
            while self._param_version < needed and not self._stop.is_set():
                self._gate.wait()
            if self._stop.is_set():
                return None
            self._positions.append(self.train_dataloader.sampler.state_dict())
            batch_dict = next(batches)
        waited = time.perf_counter() - start
        rollout = self.config.actor_rollout_ref.rollout
        batch, prompts = build_prompts(batch_dict, rollout.n, pass_rows=self.pass_rows, validate=False)
        with self._rollout_lock:
            param_version, policy_version = self._param_version, self._policy_version
            start = time.perf_counter()
            output = self.workers.rollout.generate_sequences(prompts)
            gen_s = time.perf_counter() - start
        return _Generated(step, batch, output, param_version, policy_version, gen_s, waited)

    def _put(self, item: _Generated) -> bool:
        """Put `item` into the queue, blocking while it is full; False when stopped."""
        from ray.util.queue import Full

        while not self._stop.is_set():
            try:
                self._queue.put(item, block=True, timeout=_POLL_S)
                return True
            except Full:
                continue
        return False
