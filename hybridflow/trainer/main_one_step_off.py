"""`hybridflow train-one-step-off` / `python -m hybridflow.trainer.main_one_step_off`: one-step off-policy PPO/GRPO
on split pools (verl's `one_step_off_policy.main_ppo`): the rollout pool generates the next batch while the trainer
pool trains on this one. The keys are `hybridflow train`'s, with `actor_rollout_ref.hybrid_engine=False`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config import PPO_TREE, validate_config
from hybridflow.trainer.main_ppo import check_async_training_unused, describe_ppo


def _validate(cfg):
    from hybridflow.trainer.one_step_off_policy import check_one_step_off_policy

    check_one_step_off_policy(cfg)
    check_async_training_unused(cfg, "hybridflow train-one-step-off")
    return validate_config(cfg)


def _run(cfg, batch_sizes):
    from hybridflow.trainer.one_step_off_policy import OneStepOffPolicyTrainer
    from hybridflow.trainer.run import run_ppo

    return run_ppo(cfg, batch_sizes, OneStepOffPolicyTrainer)


COMMAND = TrainerCommand(
    prog="hybridflow train-one-step-off",
    description="One-step off-policy PPO/GRPO on split pools: generation of batch k+1 overlaps training on batch k.",
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
