"""`hybridflow generate` / `python -m hybridflow.trainer.main_generation`: verl's main_generation command line
(`data.path=... data.output_path=... data.n_samples=... model.path=... rollout.*`), checked before Ray starts, then
`offline_generation.run_generation`. The flags of `hybridflow train` work too (`--help [SECTION]`, `--dry-run`,
`--cfg job`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand, aligned_table
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config.generation_checks import validate_generation_config
from hybridflow.trainer.config.loader import GENERATION_TREE


def _run(cfg, rows):
    from hybridflow.trainer.offline_generation import run_generation

    return run_generation(cfg)


COMMAND = TrainerCommand(
    prog="hybridflow generate",
    description="Sample responses for every prompt of a parquet file (verl's main_generation keys).",
    tree=GENERATION_TREE,
    validate=validate_generation_config,
    describe=lambda cfg, rows: aligned_table("generate", rows),
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
