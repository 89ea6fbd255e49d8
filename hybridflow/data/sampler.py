"""A seeded sampler whose position can be saved and restored, so a resumed run sees the same prompts.

The order of epoch `e` is `torch.randperm(n)` drawn from a generator seeded with `seed + e` (or 0..n-1
without shuffling; a seed of None is drawn once and saved in the state); the state is `(epoch, number of
indices already yielded in that epoch)`. Resuming from a saved state continues mid-epoch with exactly the
indices an uninterrupted run would have given.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["StatefulSampler", "build_sampler"]

logger = logging.getLogger(__name__)


class StatefulSampler(Sampler[int]):
    """Yields dataset indices epoch after epoch; `state_dict()` records how far the current epoch went.

    The position counts indices handed out by this sampler. A `DataLoader` with `num_workers=0` pulls
    exactly one batch of indices per step, so saving after a step is exact; with worker processes the
    loader prefetches `num_workers * prefetch_factor` batches, which the saved position then includes.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int | None) -> None:
        """seed None: one is drawn from the OS's entropy and logged; a saved state's seed then replaces it on
        `load_state_dict` (a resumed unseeded run continues its own order)."""
        if num_samples < 1:
            raise ValueError(f"a sampler needs a non-empty dataset, got {num_samples} samples")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed_drawn = seed is None
        self.seed = secrets.randbits(31) if seed is None else seed
        if self.seed_drawn and shuffle:
            logger.info("data.seed=null: drew the data order's seed %d (saved with each checkpoint; a resume takes "
                        "the saved one)", self.seed)
        self.epoch = 0
        self.position = 0  # indices of `epoch` already yielded

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples:  # the previous epoch was used up: start the next one
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)
        while self.position < self.num_samples:
            index = order[self.position]
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        """{'epoch', 'position', 'seed', 'shuffle', 'num_samples'}: plain ints/bools, safe for torch.save/json."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_samples": self.num_samples}

    def state_error(self, state: dict[str, Any]) -> str | None:
        """Why `state` cannot be continued by this sampler (None where it can): a state saved by `data.sampler`'s
        class, or for another dataset size, seed or shuffle setting (a drawn seed takes the saved one)."""
        if "num_samples" not in state:
            return ("the checkpoint's data order was saved by data.sampler.class_path's sampler; resume with the "
                    "data.sampler settings the run was saved with")
        for key in ("num_samples", "seed", "shuffle"):
            if key == "seed" and self.seed_drawn:
                continue
            if state[key] != getattr(self, key):
                held = " (the training rows after filtering)" if key == "num_samples" else ""
                return (f"the checkpoint's data order was saved with {key}={state[key]!r}{held}, and this run has "
                        f"{key}={getattr(self, key)!r}; resume with the same data.train_files, data.filter_overlong_"
                        "prompts, data.seed and data.shuffle, or start a new run")
        if not 0 <= state["position"] <= state["num_samples"]:
            return f"the checkpoint's data order is at position {state['position']}, outside 0..{state['num_samples']}"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses one `state_error` names (a drawn seed takes the saved one)."""
        error = self.state_error(state)
        if error is not None:
            raise ValueError(error)
        if self.seed_drawn and state["seed"] != self.seed:
            logger.info("data.seed=null: resuming with the saved data order's seed %d", state["seed"])
            self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def build_sampler(dataset: Sized, shuffle: bool, seed: int | None) -> StatefulSampler:
    """A resumable sampler over `dataset` (data.shuffle, data.seed): pass it to `DataLoader(sampler=...)`."""
    return StatefulSampler(len(dataset), shuffle=shuffle, seed=seed)
