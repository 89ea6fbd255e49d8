"""`hybridflow train-fully-async` / `python -m hybridflow.trainer.off_policy.main_fully_async`: fully asynchronous
PPO/GRPO on split pools (verl's `fully_async_policy.fully_async_main`): a rollouter streams batches into a bounded
queue under a staleness bound while the trainer pool trains; with `async_training.partial_rollout` a weight sync
pauses the generation in flight, which resumes under the new weights. The keys are `hybridflow train`'s, with
`actor_rollout_ref.hybrid_engine=False`, plus `async_training.*`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.main_ppo import ppo_command
from hybridflow.trainer.off_policy.checks import check_fully_async, verl_fully_async_keys

COMMAND = ppo_command(
    "hybridflow train-fully-async",
    "Fully async PPO/GRPO on split pools: a rollouter streams samples to the trainer under a staleness bound "
    "(async_training.*; partial_rollout pauses generations across a weight sync).",
    check_fully_async, "hybridflow.trainer.off_policy.fully_async_policy:FullyAsyncTrainer",
    prepare=verl_fully_async_keys,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
