"""The fully async trainer's producer: draws prompt batches in step order, generates them chunk by chunk under the
staleness gate, and hands finished ones to the trainer through one `take()`.

Two rollouters share the gate, the draw and the chunk (`Rollouter`) and differ only in who runs them:

- `ThreadedRollouter`: a background thread of the driver puts finished batches into a bounded Ray queue (real
  asynchrony; the trainer's `take()` blocks on the queue);
- `ScheduledRollouter`: runs in the trainer's thread, inside `take()`, in the order an `AsyncSchedule` gives
  (`async_training.deterministic_schedule_seed`: exact tests of staleness and partial rollout).

`VersionGate` is the state both sides share (see `fully_async_policy.py` for the bound it holds): the versions of
the rollout's weights, the syncs waiting to run, and the data positions of drawn but untrained batches.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

from ray.util.queue import Empty, Full, Queue

from hybridflow.protocol import DataProto
from hybridflow.trainer.off_policy.generation import Generation
from hybridflow.trainer.off_policy.schedule import AsyncSchedule

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often blocked queue calls look at the other thread's state (stop requests, errors)


def syncs_before(step: int, start_step: int, sync_every: int) -> int:
    """Weight syncs a run that started after `start_step` has made when it trains `step` (1-based): one after each
    step that is a multiple of `sync_every`."""
    return (step - 1) // sync_every - start_step // sync_every


class VersionGate:
    """The versions of the rollout pool's weights and the staleness bound on drawing (shared by both threads).

    `cond` guards every field; `rollout_lock` serializes the calls to the rollout pool (a chunk, a weight sync,
    validation each hold it for their whole call)."""

    def __init__(self, staleness_threshold: float, sync_every: int) -> None:
        self.staleness_threshold, self.sync_every = staleness_threshold, sync_every
        # Batches the rollouter may draw past the last sync: verl's (1 + staleness) x sync window, in whole batches.
        self.lead = max(int(math.floor((1 + staleness_threshold) * sync_every + 1e-9)), sync_every)
        # What a sample may then lag behind the weights it is trained with, in syncs.
        self.max_staleness = -(-self.lead // sync_every) - 1
        self.cond = threading.Condition()
        self.rollout_lock = threading.Lock()
        self.param_version = 0  # syncs made in this run (written under both locks)
        self.policy_version = 0  # actor updates in the rollout pool's weights
        self.sync_pending = 0  # syncs waiting for the rollout lock: the rollouter pauses before its next chunk
        self.positions: collections.deque = collections.deque()  # data positions of drawn, untrained batches
        self.start_step = 0  # the last step trained before the rollouter started
        self.stop = threading.Event()

    def is_open(self, step: int) -> bool:
        """Whether the batch of `step` may be drawn: it is at most `lead` batches past the steps whose weights the
        rollout holds (the last sync's), so trained on, it is at most `max_staleness` syncs stale."""
        synced_through = self.sync_every * (self.start_step // self.sync_every + self.param_version)
        return step <= synced_through + self.lead

    def sync(self, run_sync: Callable[[], int | None]) -> None:
        """Announce a sync (the rollouter pauses before its next chunk), run it under the rollout lock, and open
        the gate one version further; `run_sync` returns the policy version the rollout pool now holds."""
        with self.cond:
            self.sync_pending += 1
        try:
            with self.rollout_lock:
                policy_version = run_sync()
                with self.cond:
                    self.param_version += 1
                    self.policy_version = int(policy_version)
        finally:
            with self.cond:
                self.sync_pending -= 1
                self.cond.notify_all()


class Rollouter:
    """Generates the batches of steps `gate.start_step + 1 ... last_step` in order; `take()` returns the next
    finished one (its `output` set). Subclasses decide who runs the generation."""

    def __init__(
        self,
        gate: VersionGate,
        draw: Callable[[int, int], Generation],
        generate: Callable[[DataProto], DataProto],
        last_step: int,
        capacity: int,
    ) -> None:
        """
        Args:
            gate: the shared versions and bound.
            draw: (step, policy_version) -> a `Generation` whose `rollout` is a fresh `PartialRollout`.
            generate: one rollout call (the rollout pool's `generate_sequences`).
            last_step: the run's last training step.
            capacity: most finished batches waiting for the trainer.
        """
        self.gate, self.draw, self.generate = gate, draw, generate
        self.last_step, self.capacity = last_step, capacity

    def start(self, start_step: int) -> None:
        """Begin after training step `start_step`."""
        self.gate.start_step = start_step

    def take(self) -> Generation:
        """The next finished batch, in step order."""
        raise NotImplementedError

    def queue_size(self) -> int:
        """Finished batches waiting for the trainer."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop generating (idempotent)."""

    def draw_next(self, step: int, wait_s: float) -> Generation:
        """Record the data position and draw the prompts of `step` (call under `gate.cond`)."""
        generation = self.draw(step, self.gate.policy_version)
        self.gate.positions.append(generation.data_position)
        generation.wait_s = wait_s
        return generation

    def generate_chunk(self, generation: Generation) -> None:
        """One chunk of `generation` with the rollout pool's current weights (call under `gate.rollout_lock`)."""
        param_version, policy_version = self.gate.param_version, self.gate.policy_version
        start = time.perf_counter()
        output = self.generate(generation.rollout.request())
        generation.gen_s += time.perf_counter() - start
        generation.rollout.add(output, param_version, policy_version)
        if generation.rollout.done:
            generation.output, generation.rollout = generation.rollout.finish(), None


class ThreadedRollouter(Rollouter):
    """A background thread generating ahead of the trainer into a bounded Ray queue (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._queue: Queue | None = None

    def start(self, start_step: int) -> None:
        super().start(start_step)
        # The gate lets the rollouter run (1 + threshold) sync windows ahead of the trainer at most.
        # The queue's actor takes no CPU: the pools' placement groups may hold them all.
        self._queue = Queue(maxsize=self.capacity, actor_options={"num_cpus": 0})
        self._thread = threading.Thread(target=self._produce, name="rollouter", daemon=True)
        self._thread.start()

    def take(self) -> Generation:
        """The next queue item; raises the rollouter's error if it failed."""
        while True:
            if self.error is not None:
                raise RuntimeError("the rollouter thread failed") from self.error
            try:
                return self._queue.get(block=True, timeout=_POLL_S)
            except Empty:
                continue

    def queue_size(self) -> int:
        return self._queue.qsize()

    def stop(self) -> None:
        if self._thread is None:
            return
        self.gate.stop.set()
        with self.gate.cond:
            self.gate.cond.notify_all()
        self._thread.join()
        self._queue.shutdown()
        self._thread = None

    def _produce(self) -> None:
        """The rollouter thread: one generated batch per remaining step, in step order."""
        try:
            for step in range(self.gate.start_step + 1, self.last_step + 1):
                generation = self._generate(step)
                if generation is None or not self._put(generation):
                    return
        except BaseException as error:  # handed to the trainer thread, which raises it with context
            logger.error("the rollouter failed: %r", error)
            self.error = error

    def _generate(self, step: int) -> Generation | None:
        """Wait at the staleness gate, draw the prompts of `step` and generate them chunk by chunk, pausing while a
        sync is pending (None when stopped)."""
        gate, start = self.gate, time.perf_counter()
        with gate.cond:
            while not gate.is_open(step) and not gate.stop.is_set():
                gate.cond.wait()
            if gate.stop.is_set():
                return None
            generation = self.draw_next(step, time.perf_counter() - start)
        while generation.output is None:
            with gate.cond:
                while gate.sync_pending and not gate.stop.is_set():
                    gate.cond.wait()
                if gate.stop.is_set():
                    return None
            with gate.rollout_lock:
                self.generate_chunk(generation)
        return generation

    def _put(self, generation: Generation) -> bool:
        """Put `generation` into the queue, blocking while it is full; False when stopped."""
        while not self.gate.stop.is_set():
            try:
                self._queue.put(generation, block=True, timeout=_POLL_S)
                return True
            except Full:
                continue
        return False


class ScheduledRollouter(Rollouter):
    """Generation in the trainer's thread, interleaved with training in the order `schedule` gives."""

    def __init__(self, *args, schedule: AsyncSchedule, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self._in_flight: Generation | None = None
        self._finished: collections.deque = collections.deque()
        self._next_step = 1

    def start(self, start_step: int) -> None:
        super().start(start_step)
        self._next_step = start_step + 1

    def take(self) -> Generation:
        """Run the schedule's events until it trains: generate chunks, then hand over the next finished batch."""
        while True:
            event = self.schedule.next_event(can_generate=self._can_generate(), can_train=bool(self._finished))
            if event == "train":
                return self._finished.popleft()
            if self._in_flight is None:
                self._in_flight = self.draw_next(self._next_step, 0.0)
                self._next_step += 1
            self.generate_chunk(self._in_flight)
            if self._in_flight.output is not None:
                self._finished.append(self._in_flight)
                self._in_flight = None

    def queue_size(self) -> int:
        return len(self._finished)

    def _can_generate(self) -> bool:
        """A batch is in flight, or the next one may be drawn (steps left, gate open, room in the queue)."""
        if self._in_flight is not None:
            return True
        step = self._next_step
        room = len(self._finished) < self.capacity
        return step <= self.last_step and room and self.gate.is_open(step)
