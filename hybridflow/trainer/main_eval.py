"""`hybridflow score` / `python -m hybridflow.trainer.main_eval`: verl's main_eval command line
(`data.path=... data.response_key=responses custom_reward_function.path=...`), checked before any scorer starts,
then `offline_evaluation.run_evaluation`. The flags of `hybridflow train` work too (`--help [SECTION]`,
`--dry-run`, `--cfg job`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand, aligned_table
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config.evaluation_checks import evaluation_table, validate_evaluation_config
from hybridflow.trainer.config.loader import EVALUATION_TREE


def _run(cfg, rows):
    from hybridflow.trainer.offline_evaluation import run_evaluation

    return run_evaluation(cfg, rows)


COMMAND = TrainerCommand(
    prog="hybridflow score",
    description="Score the generated responses of a parquet file per data source (verl's main_eval keys).",
    tree=EVALUATION_TREE,
    validate=validate_evaluation_config,
    describe=lambda cfg, rows: aligned_table("score", evaluation_table(cfg, rows)),
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Score; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
