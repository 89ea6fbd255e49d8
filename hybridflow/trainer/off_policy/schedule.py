"""A deterministic interleaving of the fully async trainer's rollouter and trainer, for exact tests of asynchrony.

In a real run the rollouter thread and the trainer thread race; how far the rollouter gets between two training
steps depends on timing. `AsyncSchedule` replaces the race by a fixed sequence of events, run in the driver's one
thread (`async_training.deterministic_schedule_seed`):

- `generate`: the rollouter generates one chunk (drawing the next prompt batch first if none is in flight);
- `train`: the trainer takes the next finished batch and runs one step (its weight sync, when one is due, comes at
  the end of the step, as in the threaded run).

At each decision the caller says which events are possible (generation: a batch in flight, or the staleness gate
and the queue let one be drawn; training: a finished batch waits). A seeded schedule picks among the possible ones
with a `random.Random(seed)`, so the same seed gives the same interleaving every run; an explicit schedule replays
a given list and fails when an event is not possible at its turn. A scripted `train` may come before its batch is
finished: it then generates the remaining chunks first (so "train" alone is the synchronous order).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

Event = Literal["generate", "train"]
EVENTS: tuple[Event, ...] = ("generate", "train")


class AsyncSchedule:
    """The order of `generate` and `train` events: drawn from a seed, or replayed from a list (see the module)."""

    def __init__(self, seed: int | None = None, events: Sequence[Event] | None = None) -> None:
        """Exactly one of `seed` (random choices among the possible events) and `events` (a script)."""
        if (seed is None) == (events is None):
            raise ValueError("AsyncSchedule takes exactly one of seed= and events=")
        unknown = sorted({event for event in events or () if event not in EVENTS})
        if unknown:
            raise ValueError(f"unknown schedule events {unknown}; known: {list(EVENTS)}")
        self._rng = random.Random(seed) if seed is not None else None
        self._script = list(events or ())
        self.history: list[Event] = []
        """The events decided so far (scripted trains that first generated count as their generates, then train)."""

    def next_event(self, *, can_generate: bool, can_train: bool) -> Event:
        """The next event, given which ones are possible now. A scripted `train` whose batch is not finished is
        returned as `generate` (without consuming the script) until it is."""
        if not (can_generate or can_train):
            raise RuntimeError("async schedule: neither generation nor training is possible (internal error)")
        event = self._scripted(can_generate, can_train) if self._rng is None else self._drawn(can_generate, can_train)
        self.history.append(event)
        return event

    def _drawn(self, can_generate: bool, can_train: bool) -> Event:
        if can_generate and can_train:
            return "generate" if self._rng.random() < 0.5 else "train"
        return "generate" if can_generate else "train"

    def _scripted(self, can_generate: bool, can_train: bool) -> Event:
        position = len(self.history)
        if not self._script:
            raise ValueError(f"async schedule: the scripted events ran out after {position} events")
        wanted = self._script[0]
        if wanted == "train" and not can_train and can_generate:
            return "generate"  # finish the next batch first
        if (wanted == "train" and not can_train) or (wanted == "generate" and not can_generate):
            raise ValueError(
                f"async schedule: event {position} ({wanted!r}) is not possible now (can_generate={can_generate}, "
                f"can_train={can_train}); fix the scripted events"
            )
        self._script.pop(0)
        return wanted
