"""verl's `rollout.skip_rollout` (a debugging aid): the first training generation of a run is dumped to
`rollout.skip_dump_dir`, and every later one, in this run and in later runs with the same name and batch shape,
replays that dump instead of generating, so the training stages can be profiled or debugged without the cost of
generation. The dump holds the whole generated batch (its prompt rows, ground truths and responses), so what is
scored and trained on stays consistent; the prompts the data loader draws meanwhile are not used. Validation
always generates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hybridflow.data.config import expand_path
from hybridflow.protocol import DataProto

__all__ = ["RolloutReplay", "replay_name"]

logger = logging.getLogger(__name__)


def replay_name(project: str, experiment: str, prompts_per_batch: int, n: int) -> str:
    """The dump's file name, from what shapes it (verl's: experiment, project, generation batch size and n)."""
    return f"{experiment}_{project}_GBS{prompts_per_batch}__N{n}.pt"


class RolloutReplay:
    """Generates once and dumps, or replays the dump (see the module docstring)."""

    def __init__(self, dump_dir: str, name: str) -> None:
        self.path = expand_path(dump_dir).resolve() / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("rollout.skip_rollout: training generations %s %s", "replay" if self.path.exists() else
                    "are generated once and dumped to", self.path)

    def generate(self, generate: Callable[[], tuple[DataProto, dict]]) -> tuple[DataProto, dict[str, float]]:
        """The dumped batch (and metrics saying so), or `generate()`'s batch, dumped first when none exists."""
        if self.path.exists():
            return DataProto.load_from_disk(self.path), {"rollout_skip/replayed": 1.0}
        batch, metrics = generate()
        batch.save_to_disk(self.path)  # staged and renamed: a dump is whole or absent
        logger.info("rollout.skip_rollout: dumped this step's generation to %s", self.path)
        return batch, {**metrics, "rollout_skip/replayed": 0.0}
