"""`hybridflow sft` / `python -m hybridflow.trainer.sft.main`: compose, check, then run SFT (local or on Ray).

Arguments are Hydra overrides with verl's SFT keys (`data.train_files=[...] model.partial_pretrain=...
model.lora_rank=8 ...`) and the flags of `hybridflow train` (`--help [SECTION]`, `--dry-run`, `--cfg job`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand, aligned_table
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config import SFT_TREE
from hybridflow.trainer.sft.validate import validate_sft_config


def _run(cfg, table):
    from hybridflow.trainer.sft.trainer import run_sft

    return run_sft(cfg)


COMMAND = TrainerCommand(
    prog="hybridflow sft",
    description="Supervised fine-tuning, full weights or LoRA, with verl's SFT config keys.",
    tree=SFT_TREE,
    validate=validate_sft_config,
    describe=lambda cfg, sizes: aligned_table("sft", sizes),
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run SFT; config errors print one line naming the key and exit with code 2."""
    return run_command(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
