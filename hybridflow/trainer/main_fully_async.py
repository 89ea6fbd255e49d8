"""`hybridflow train-fully-async` / `python -m hybridflow.trainer.main_fully_async`: fully asynchronous PPO/GRPO on
split pools (verl's `fully_async_policy.fully_async_main`): a rollouter streams batches into a bounded queue under a
staleness bound while the trainer pool trains. The keys are `hybridflow train`'s, with
`actor_rollout_ref.hybrid_engine=False`, plus `async_training.*`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config import PPO_TREE, validate_config
from hybridflow.trainer.main_ppo import describe_ppo


def _validate(cfg):
    from hybridflow.trainer.fully_async_policy import check_fully_async

    check_fully_async(cfg)
    return validate_config(cfg)


def _run(cfg, batch_sizes):
    from hybridflow.trainer.fully_async_policy import FullyAsyncTrainer
    from hybridflow.trainer.run import run_ppo

    return run_ppo(cfg, batch_sizes, FullyAsyncTrainer)


COMMAND = TrainerCommand(
    prog="hybridflow train-fully-async",
    description="Fully async PPO/GRPO on split pools: a rollouter streams samples to the trainer under a "
    "staleness bound (async_training.*).",
    tree=PPO_TREE,
    validate=_validate,
    describe=describe_ppo,
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
