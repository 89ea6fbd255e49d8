"""`hybridflow train` / `python -m hybridflow.trainer.main_ppo`: compose, check, then run PPO/GRPO on Ray.

Arguments are Hydra overrides with verl's keys (`algorithm.adv_estimator=grpo data.train_batch_size=8 ...`);
`--help [SECTION]` lists the keys, `--dry-run` checks without starting Ray, `--cfg job` prints the config.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.trainer.command import TrainerCommand
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config import PPO_TREE, validate_config


def check_async_training_unused(cfg, command: str) -> None:
    """`async_training.*` is read only by `hybridflow train-fully-async`: other commands refuse a changed value."""
    from hybridflow.trainer.config.async_schema import AsyncTrainingConfig

    if cfg.async_training != AsyncTrainingConfig():
        raise ValueError(
            f"async_training.* is read only by `hybridflow train-fully-async`, not by `{command}`: "
            "leave it at its defaults or run train-fully-async"
        )
    for key in ("total_rollout_steps", "total_epochs", "test_freq"):
        if getattr(cfg.rollout, key) is not None:
            raise ValueError(
                f"rollout.{key}={getattr(cfg.rollout, key)} is verl's fully async rollouter's key, read only by "
                f"`hybridflow train-fully-async`, not by `{command}`: use trainer.total_training_steps / "
                "trainer.total_epochs / trainer.test_freq"
            )


def describe_ppo(cfg, batch_sizes) -> str:
    """The dry-run tables: batch arithmetic per updated model, then the placement."""
    from hybridflow.trainer.placement import describe_placement

    tables = [sizes.table(name) for name, sizes in batch_sizes.items()]
    return "\n".join([*tables, describe_placement(cfg)])


def ppo_command(
    prog: str, description: str, check: Callable[[Any], None], trainer_class: str | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> TrainerCommand:
    """A PPO-family command: `check(cfg)`, then `validate_config`; the run is `run_ppo` with the trainer class named
    by `trainer_class` ('module:Class', imported when the run starts), or `RayPPOTrainer`. `prepare`: see
    `TrainerCommand.prepare`."""

    def validate(cfg):
        check(cfg)
        return validate_config(cfg)

    def run(cfg, batch_sizes):
        from hybridflow.trainer.run import run_ppo

        if trainer_class is None:
            return run_ppo(cfg, batch_sizes)
        module, name = trainer_class.split(":")
        return run_ppo(cfg, batch_sizes, getattr(importlib.import_module(module), name))

    return TrainerCommand(prog=prog, description=description, tree=PPO_TREE, validate=validate, describe=describe_ppo,
                          run=run, prepare=prepare)


COMMAND = ppo_command(
    "hybridflow train", "Run PPO-family RL (PPO, GRPO, RLOO, REINFORCE++, ...) with verl's config keys.",
    lambda cfg: check_async_training_unused(cfg, "hybridflow train"),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
