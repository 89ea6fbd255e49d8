"""verl's `main_generation_server` with the module name changed: `python -m hybridflow.trainer.main_generation_server
actor_rollout_ref.model.path=... actor_rollout_ref.rollout.n=4 data.train_files=prompts.parquet
+data.output_path=out.parquet ...`. verl serves the model behind OpenAI-style endpoints and sends each chat to them;
hybridflow generates the same samples with `hybridflow generate` on its rollout workers (`GENERATION_SERVER_TREE`
maps the keys), and writes the rows with their `responses` as verl does."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config.loader import GENERATION_SERVER_TREE
from hybridflow.trainer.main_generation import COMMAND as GENERATE

__all__ = ["COMMAND", "main"]

COMMAND = dataclasses.replace(
    GENERATE,
    prog="hybridflow generate (verl main_generation_server keys)",
    description="Sample responses for every prompt of a parquet file (verl's main_generation_server keys).",
    tree=GENERATION_SERVER_TREE,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate; config errors print one line naming the key (as written) and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
