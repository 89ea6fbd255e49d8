"""`hybridflow sft` / `python -m hybridflow.trainer.sft.main` (also `hybridflow.trainer.fsdp_sft_trainer`, verl's
module name): compose, check, then run SFT (local or on Ray).

Arguments are Hydra overrides with verl's SFT keys (`data.train_files=[...] model.partial_pretrain=...
model.lora_rank=8 ...`) and the flags of `hybridflow train` (`--help [SECTION]`, `--dry-run`, `--cfg job`).
Started by torchrun, as verl's SFT lines are, rank 0 runs the job with torchrun's process count as its worker
count and the other ranks exit (`torchrun_launch`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from hybridflow.trainer.command import TrainerCommand, aligned_table
from hybridflow.trainer.command import main as run_command
from hybridflow.trainer.config import SFT_TREE
from hybridflow.trainer.config.loader import SFT_ENGINE_TREE
from hybridflow.trainer.sft.validate import validate_sft_config
from hybridflow.trainer.torchrun_launch import clear_torchrun_environment, driver_overrides, torchrun_launch


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


ENGINE_COMMAND = dataclasses.replace(
    COMMAND,
    prog="hybridflow sft (verl engine SFT)",
    description="Supervised fine-tuning with the keys and defaults of verl's engine-based SFT (sft_trainer_engine).",
    tree=SFT_ENGINE_TREE,
)


def main(argv: Sequence[str] | None = None, command: TrainerCommand = COMMAND) -> int:
    """Run SFT; config errors print one line naming the key and exit with code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = torchrun_launch(os.environ)
    if launch is None:
        return run_command(command, argv)
    try:
        argv = driver_overrides(launch, argv)
    except ValueError as err:  # every rank says it: torchrun stops the others when the first one exits
        print(f"{command.prog}: config error: {err}", file=sys.stderr)
        return 2
    if launch.rank != 0:
        print(f"{command.prog}: torchrun rank {launch.rank} of {launch.world_size}: the driver on rank 0 runs all "
              f"{launch.world_size} workers on Ray; this process exits", file=sys.stderr)
        return 0
    clear_torchrun_environment()
    return run_command(command, argv)


if __name__ == "__main__":
    sys.exit(main())
