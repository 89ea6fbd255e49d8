"""Samplers of a user's (verl's data.sampler.class_path) for the tests: a curriculum that walks the data backwards
and records the batches it is handed, and one without a state of its own."""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

UPDATES: list[int] = []
"""Rows of each batch handed to ReverseCurriculumSampler.update, in order (the tests clear it)."""


class ReverseCurriculumSampler(Sampler[int]):
    """Indices from last to first; `update` records the batch size. Its state holds its position in the epoch
    (a sampler with a state of its own keeps its position there, as torchdata's stateful samplers do) and the
    updates it has seen."""

    def __init__(self, data_source: Sized, data_config) -> None:
        self.size, self.seed, self.updates, self.given = len(data_source), data_config.get("seed"), 0, 0

    def __iter__(self) -> Iterator[int]:
        while self.given < self.size:
            self.given += 1
            yield self.size - self.given
        self.given = 0

    def __len__(self) -> int:
        return self.size

    def update(self, batch) -> None:
        UPDATES.append(len(batch))
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates, "given": self.given}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.given = state["updates"], state["given"]


class PlainOrderSampler(Sampler[int]):
    """0, 1, 2, ... with no state_dict: a resume fast-forwards it."""

    def __init__(self, data_source: Sized, data_config) -> None:
        self.size = len(data_source)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size))

    def __len__(self) -> int:
        return self.size


class NotASampler:
    def __init__(self, data_source, data_config) -> None:
        pass
