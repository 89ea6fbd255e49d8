"""`hybridflow train-one-step-off` / `python -m hybridflow.trainer.off_policy.main_one_step_off`: one-step off-policy
PPO/GRPO on split pools (verl's `one_step_off_policy.main_ppo`): the rollout pool generates the next batch while the
trainer pool trains on this one. The keys are `hybridflow train`'s, with `actor_rollout_ref.hybrid_engine=False`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.main_ppo import check_async_training_unused, ppo_command
from hybridflow.trainer.off_policy.checks import check_one_step_off_policy, single_turn_batch_generation


def _check(cfg) -> None:
    check_one_step_off_policy(cfg)
    check_async_training_unused(cfg, "hybridflow train-one-step-off")


COMMAND = ppo_command(
    "hybridflow train-one-step-off",
    "One-step off-policy PPO/GRPO on split pools: generation of batch k+1 overlaps training on batch k.",
    _check, "hybridflow.trainer.off_policy.one_step_off_policy:OneStepOffPolicyTrainer",
    prepare=single_turn_batch_generation,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
