"""verl's engine-SFT module name: `torchrun --nproc_per_node=N -m hybridflow.trainer.sft_trainer <verl's
sft_trainer_engine keys>` (`engine=fsdp optim=fsdp engine.* checkpoint.* data.messages_key ...`) runs `hybridflow
sft` with verl's engine-SFT defaults (`SFT_ENGINE_TREE`); under torchrun rank 0 drives N workers on Ray."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridflow.trainer.sft.main import ENGINE_COMMAND
from hybridflow.trainer.sft.main import main as sft_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run engine-keyed SFT; config errors print one line naming the key and exit with code 2."""
    return sft_main(argv, ENGINE_COMMAND)


if __name__ == "__main__":
    sys.exit(main())
