"""A sampler class of the user's (verl's `data.sampler.class_path` / `class_name`, e.g. a curriculum), loaded and
wrapped so that checkpoints record its position and curriculum samplers see every trained batch.

The class is built as verl builds it: `cls(data_source=dataset, data_config=<the data section as an OmegaConf
DictConfig>)`, and must be a `torch.utils.data.Sampler`. `class_path` is a Python file, or `pkg://package.module`
for an importable module (verl's two spellings).

A sampler with an `update(batch)` method (verl's AbstractCurriculumSampler) is called with each step's trained
batch (a DataProto), after the update and before the step's checkpoint, so that a resumed run continues the
curriculum it saved. Resume: a sampler with `state_dict()` / `load_state_dict()` saves and restores its own state,
its position in the epoch included (as torchdata's stateful samplers do; it is not fast-forwarded); one without them is fast-forwarded past the indices it had given in its epoch (torchdata's StatefulDataLoader does
the same), which reproduces its order only if the sampler's order is deterministic: a warning says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

from torch.utils.data import Sampler

from hybridflow.data.config import DataSamplerConfig

__all__ = ["UserSampler", "build_user_sampler", "load_sampler_class"]

logger = logging.getLogger(__name__)

PACKAGE_PREFIX = "pkg://"


def load_sampler_class(config: DataSamplerConfig) -> type:
    """`class_name` from `class_path`, checked to be a torch Sampler subclass; errors name the key."""
    from hybridflow.utils.file_module import import_file

    where = f"data.sampler.class_path={config.class_path!r}"
    if config.class_path.startswith(PACKAGE_PREFIX):
        module_name = config.class_path[len(PACKAGE_PREFIX):]
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{where}: cannot import module {module_name!r}: {err}") from err
    else:
        try:
            module = import_file(str(Path(config.class_path).expanduser().resolve()), "hybridflow_sampler_",
                                 "data.sampler.class_path")
        except FileNotFoundError as err:
            raise ValueError(str(err)) from err
    cls = getattr(module, config.class_name, None)
    if cls is None:
        raise ValueError(f"data.sampler.class_name={config.class_name!r} is not defined in {config.class_path}")
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ValueError(f"data.sampler.class_name={config.class_name!r} must be a class deriving from "
                         "torch.utils.data.Sampler (verl's AbstractSampler / AbstractCurriculumSampler are)")
    return cls


class UserSampler(Sampler[int]):
    """The user's sampler, counting the indices it gives per epoch (the resume position), and forwarding `update`."""

    def __init__(self, sampler: Sampler, seed: int | None) -> None:
        self.sampler, self.seed = sampler, seed
        self.epoch, self.position, self._skip = 0, 0, 0
        self._finished = False

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        if self._finished:
            self.epoch, self.position, self._finished = self.epoch + 1, 0, False
        skip, self._skip = self._skip, 0
        for index in self.sampler:
            if skip:
                skip -= 1
                continue
            self.position += 1
            yield index
        self._finished = True

    def update(self, batch: Any) -> None:
        """Hand a trained batch to a curriculum sampler (no-op for others)."""
        update = getattr(self.sampler, "update", None)
        if callable(update):
            update(batch=batch)

    def state_dict(self) -> dict[str, Any]:
        """{'epoch', 'position', 'finished', 'sampler'}: the sampler's own state where it has one, else None."""
        own = self.sampler.state_dict() if callable(getattr(self.sampler, "state_dict", None)) else None
        return {"epoch": self.epoch, "position": self.position, "finished": self._finished, "sampler": own}

    def state_error(self, state: dict[str, Any]) -> str | None:
        """Why `state` cannot be continued (None where it can): one saved by hybridflow's own sampler."""
        if "sampler" not in state:
            return ("the checkpoint's sampler state was saved without data.sampler.class_path; resume with the "
                    "data.sampler settings the run was saved with")
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see the module doc); refuses one `state_error` names."""
        error = self.state_error(state)
        if error is not None:
            raise ValueError(error)
        self.epoch, self.position, self._finished = int(state["epoch"]), int(state["position"]), bool(state["finished"])
        if state["sampler"] is not None and callable(getattr(self.sampler, "load_state_dict", None)):
            self.sampler.load_state_dict(state["sampler"])
            return
        self._skip = 0 if self._finished else self.position
        logger.warning(
            "data.sampler %s has no state_dict/load_state_dict: the resumed run skips the %d indices it had given in "
            "epoch %d, which repeats the saved order only if the sampler's order is deterministic",
            type(self.sampler).__name__, self._skip, self.epoch)


def build_user_sampler(dataset: Sized, data_config: Any) -> UserSampler:
    """The `data.sampler` class built over `dataset` with the data section (as verl passes it), wrapped."""
    from omegaconf import OmegaConf

    cls = load_sampler_class(data_config.sampler)
    sampler = cls(data_source=dataset, data_config=OmegaConf.create(dataclasses.asdict(data_config)))
    if not isinstance(sampler, Sampler):
        raise ValueError(f"data.sampler.class_name={data_config.sampler.class_name!r} built {type(sampler).__name__}, "
                         "not a torch.utils.data.Sampler")
    return UserSampler(sampler, getattr(data_config, "seed", None))
