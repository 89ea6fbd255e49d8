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

- Generation is a sequence of chunks (`trainer/partial_rollout.py`): with `async_training.partial_rollout` each call
  generates at most `partial_rollout_chunk_tokens` new tokens and unfinished responses are continued by the next
  call; without it a batch is one call. `_rollout_lock` serializes the calls to the rollout pool: a chunk, a weight
  sync (whose receiving side runs on the rollout ranks) and validation each hold it for their whole call. A sync
  announces itself (`_sync_pending`) so the rollouter pauses before its next chunk: the sync waits for one chunk,
  and the batch in flight resumes under the new weights (its KV cache recomputed by the chunk's prefill).
- `_gate` (a condition) holds the policy version (`param_version`, verl's name: syncs done in this run) and the
  data positions of the drawn but untrained batches. Before drawing the batch of step s, the rollouter waits
  until `syncs_before(s) - param_version <= staleness_threshold`, where `syncs_before(s)` is the number of syncs
  the trainer will have made when it trains step s. Every token of the batch is sampled at that version or later,
  so a sample's staleness, counted from its OLDEST token (versions between the weights that sampled its first
  token and the rollout's weights when it is trained on), is at most the threshold; with 0 the run is synchronous
  (each batch is generated after the previous step's sync: the same samples and metrics as `hybridflow train` on
  the same split pools with trigger_parameter_sync_step=1).

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

`async_training.deterministic_schedule_seed` replaces the thread by an `AsyncSchedule` run in the driver's thread
(for tests: the interleaving of chunks, trains and syncs is fixed by the seed). Agent loops (rollout.mode=async)
are refused. A checkpoint records the data position before the oldest drawn but untrained batch; a resumed run
generates those batches again.
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
from hybridflow.trainer.async_schedule import AsyncSchedule
from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.generation import build_prompts, join_responses
from hybridflow.trainer.one_step_off_policy import check_off_policy_trainer
from hybridflow.trainer.partial_rollout import PartialRollout, compute_version_metrics
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.scaffold import timer

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often blocked queue calls look at the other thread's state (stop requests, errors)


def check_fully_async(cfg: PPOConfig) -> None:
    """What the fully async trainer needs: an off-policy trainer's (`check_off_policy_trainer`), a fixed sync
    schedule, and partial-rollout chunks shorter than a response."""
    check_off_policy_trainer(cfg, "fully async", [
        (cfg.trainer.critic_warmup > 0, f"trainer.critic_warmup={cfg.trainer.critic_warmup}",
         "the rollouter's staleness gate counts on a weight sync every trigger_parameter_sync_step steps; set it to 0"),
    ])
    async_cfg, length = cfg.async_training, cfg.actor_rollout_ref.rollout.response_length
    if async_cfg.partial_rollout and async_cfg.partial_rollout_chunk_tokens >= length:
        raise ValueError(
            f"async_training.partial_rollout_chunk_tokens={async_cfg.partial_rollout_chunk_tokens} is not below "
            f"actor_rollout_ref.rollout.response_length={length}: every response would be one call, which no sync "
            f"can pause; lower it (e.g. to {max(1, length // 4)}) or set async_training.partial_rollout=False"
        )


def syncs_before(step: int, start_step: int, sync_every: int) -> int:
    """Weight syncs a run that started after `start_step` has made when it trains `step` (1-based): one after each
    step that is a multiple of `sync_every`."""
    return (step - 1) // sync_every - start_step // sync_every


@dataclass
class _Generation:
    """A batch being generated: its prompt rows and its chunked rollout."""

    step: int
    batch: DataProto
    rollout: PartialRollout
    wait_s: float
    gen_s: float = 0.0


@dataclass
class _Generated:
    """One queue item: a generated (unscored) batch; `output` carries the per-token versions."""

    step: int
    batch: DataProto
    output: DataProto
    gen_s: float
    wait_s: float

    @classmethod
    def of(cls, generation: _Generation) -> _Generated:
        return cls(generation.step, generation.batch, generation.rollout.finish(), generation.gen_s,
                   generation.wait_s)


class FullyAsyncTrainer(RayPPOTrainer):
    """`RayPPOTrainer` fed by a rollouter (a thread, or a seeded schedule) through a bounded queue under a staleness
    bound; weight syncs every `async_training.trigger_parameter_sync_step` steps. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        async_cfg = self.config.async_training
        self.staleness_threshold = int(async_cfg.staleness_threshold)
        self.sync_every = async_cfg.trigger_parameter_sync_step
        self.capacity = (self.staleness_threshold + 1) * self.sync_every  # queue size: the gate's lead, at most
        rollout = self.config.actor_rollout_ref.rollout
        # Without partial rollout a batch is one call: its chunk is the whole response.
        self.chunk_tokens = rollout.response_length
        if async_cfg.partial_rollout:
            self.chunk_tokens = async_cfg.partial_rollout_chunk_tokens
        seed = async_cfg.deterministic_schedule_seed
        self.schedule = None if seed is None else self.build_schedule(seed)
        self._rollout_lock = threading.Lock()
        self._gate = threading.Condition()
        self._param_version = 0  # syncs made in this run (written under both locks)
        self._policy_version = 0  # actor updates in the rollout pool's weights
        self._sync_pending = 0  # syncs waiting for the rollout lock: the rollouter pauses before its next chunk
        self._positions: collections.deque = collections.deque()  # data positions of drawn, untrained batches
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._started = False
        self._rollouter: threading.Thread | None = None
        self._queue: Any = None
        self._start_step = 0
        # The scheduled rollouter's state (deterministic_schedule_seed): the batch in flight, the finished ones.
        self._in_flight: _Generation | None = None
        self._finished: collections.deque = collections.deque()
        self._next_step = 1

    def build_schedule(self, seed: int) -> AsyncSchedule:
        """The schedule of a deterministic run (tests override it to script the events)."""
        return AsyncSchedule(seed=seed)

    # ------------------------------------------------------------------ the trainer side
    def fit(self) -> dict[str, float]:
        """`RayPPOTrainer.fit`, stopping the rollouter however it ends."""
        try:
            return super().fit()
        finally:
            self._stop_rollouter()

    def sample(self, batches, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """This step's batch from the queue (starting the rollouter on the first call), scored."""
        if not self._started:
            self._start_rollouter(batches)
        with timer("gen", timing):  # only the wait that the rollouter's lead did not hide
            item = self._take() if self.schedule is None else self._take_scheduled(batches)
        assert item.step == self.global_steps, (item.step, self.global_steps)
        with self._gate:
            self._positions.popleft()
        batch, gen_metrics = join_responses(item.batch, item.output)
        metrics.update(gen_metrics)
        metrics.update(self._tag_versions(batch))
        metrics.update({
            "fully_async/queue_size": float(self._queue_size()),
            "fully_async/param_version": float(self._param_version),
            "fully_async/num_dropped_samples": 0.0,
            "fully_async/rollout_gen_s": item.gen_s,
            "fully_async/rollouter_wait_s": item.wait_s,
        })
        self.score_into(batch, metrics, timing)
        return batch

    def _tag_versions(self, batch: DataProto) -> dict[str, float]:
        """Per-sample version columns (the oldest token's: every row's first token is from the batch's first
        chunk) and the staleness and partial-rollout metrics."""
        tokens = batch.batch["token_param_versions"]
        assert bool((tokens[:, 0] >= 0).all()), "every response has a first token"
        oldest = tokens[:, 0]
        staleness = self._param_version - oldest
        within = (staleness >= 0) & (staleness <= self.staleness_threshold)
        assert bool(within.all()), (staleness, self._param_version)
        batch.batch["rollout_param_version"] = oldest.clone()
        batch.batch["rollout_policy_version"] = batch.batch["token_policy_versions"][:, 0].clone()
        batch.batch["staleness"] = staleness
        values = staleness.float()
        return {
            "rollout/staleness/mean": float(values.mean()),
            "rollout/staleness/min": float(values.min()),
            "rollout/staleness/max": float(values.max()),
            **compute_version_metrics(tokens, batch.batch["response_mask"], self._param_version),
        }

    def _queue_size(self) -> int:
        return len(self._finished) if self.schedule is not None else self._queue.qsize()

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
        """Every `trigger_parameter_sync_step` steps and after the last: pause the rollouter before its next chunk,
        sync, and open its gate one version further. (Before the rollouter starts, e.g. on resume, a plain sync
        that counts no version.)"""
        if not self._started:
            super().sync_rollout_weights(metrics, timing)
            self._policy_version = int(metrics.get("sync_rollout_weights/policy_version", self._policy_version))
            return
        last = self.global_steps >= self.total_training_steps
        if self.global_steps % self.sync_every != 0 and not last:
            return
        synced: dict[str, float] = {}
        with self._gate:
            self._sync_pending += 1
        try:
            with self._rollout_lock:
                super().sync_rollout_weights(synced, timing)
                with self._gate:
                    self._param_version += 1
                    self._policy_version = int(synced["sync_rollout_weights/policy_version"])
        finally:
            with self._gate:
                self._sync_pending -= 1
                self._gate.notify_all()
        metrics.update(synced)

    def validate(self) -> dict[str, float]:
        """Validation on the rollout pool, between two of the rollouter's chunks."""
        with self._rollout_lock:
            return super().validate()

    def idle_processes(self) -> list:
        """Not the rollout pool once the rollouter thread runs: a ping would queue behind its generation."""
        if self._rollouter is None:
            return super().idle_processes()
        return self.workers.processes_besides_rollout()

    def data_position(self) -> dict[str, Any]:
        """Before the oldest batch drawn but not yet trained on."""
        with self._gate:
            if self._positions:
                return self._positions[0]
            return super().data_position()

    # ------------------------------------------------------------------ generation (both rollouters)
    def _gate_open(self, step: int) -> bool:
        """Whether the batch of `step` may be drawn: trained on, it will be at most staleness_threshold stale."""
        needed = syncs_before(step, self._start_step, self.sync_every) - self.staleness_threshold
        return self._param_version >= needed

    def _draw(self, step: int, batches, wait_s: float) -> _Generation:
        """Record the data position and draw the prompts of `step` (call under `_gate`)."""
        self._positions.append(self.train_dataloader.sampler.state_dict())
        rollout = self.config.actor_rollout_ref.rollout
        batch, prompts = build_prompts(next(batches), rollout.n, pass_rows=self.pass_rows, validate=False)
        tokenizer = self.reward_fn.tokenizer
        partial = PartialRollout(
            prompts, rollout.response_length, self.chunk_tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id
        )
        return _Generation(step, batch, partial, wait_s)

    def _generate_chunk(self, generation: _Generation) -> None:
        """One chunk of `generation` with the rollout pool's current weights (call under `_rollout_lock`)."""
        param_version, policy_version = self._param_version, self._policy_version
        start = time.perf_counter()
        output = self.workers.rollout.generate_sequences(generation.rollout.request())
        generation.gen_s += time.perf_counter() - start
        generation.rollout.add(output, param_version, policy_version)

    # ------------------------------------------------------------------ the rollouter thread
    def _start_rollouter(self, batches) -> None:
        self._started = True
        self._start_step = self.global_steps - 1  # sample() runs inside the first step
        self._next_step = self.global_steps
        if self.schedule is not None:
            return
        from ray.util.queue import Queue

        # The gate lets the rollouter run (1 + threshold) sync windows ahead of the trainer at most.
        # The queue's actor takes no CPU: the pools' placement groups may hold them all.
        self._queue = Queue(maxsize=self.capacity, actor_options={"num_cpus": 0})
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
        """Wait at the staleness gate, draw the prompts of `step` and generate them chunk by chunk, pausing while a
        sync is pending (None when stopped)."""
        start = time.perf_counter()
        with self._gate:
            while not self._gate_open(step) and not self._stop.is_set():
                self._gate.wait()
            if self._stop.is_set():
                return None
            generation = self._draw(step, batches, 0.0)
        generation.wait_s = time.perf_counter() - start
        while not generation.rollout.done:
            with self._gate:
                while self._sync_pending and not self._stop.is_set():
                    self._gate.wait()
                if self._stop.is_set():
                    return None
            with self._rollout_lock:
                self._generate_chunk(generation)
        return _Generated.of(generation)

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

    # ------------------------------------------------------------------ the scheduled rollouter (deterministic)
    def _take_scheduled(self, batches) -> _Generated:
        """Run the schedule's events until it trains: generate chunks, then hand over the next finished batch."""
        while True:
            event = self.schedule.next_event(can_generate=self._can_generate(), can_train=bool(self._finished))
            if event == "train":
                return self._finished.popleft()
            if self._in_flight is None:
                self._in_flight = self._draw(self._next_step, batches, 0.0)
                self._next_step += 1
            self._generate_chunk(self._in_flight)
            if self._in_flight.rollout.done:
                self._finished.append(_Generated.of(self._in_flight))
                self._in_flight = None

    def _can_generate(self) -> bool:
        """A batch is in flight, or the next one may be drawn (steps left, gate open, room in the queue)."""
        if self._in_flight is not None:
            return True
        step = self._next_step
        room = len(self._finished) < self.capacity
        return step <= self.total_training_steps and room and self._gate_open(step)
