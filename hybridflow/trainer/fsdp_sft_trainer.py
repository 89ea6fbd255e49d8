"""verl's SFT module name: `torchrun --nproc_per_node=N -m hybridflow.trainer.fsdp_sft_trainer <verl's SFT keys>`
runs `hybridflow sft` (see `hybridflow.trainer.sft.main`: under torchrun, rank 0 drives N workers on Ray)."""

from __future__ import annotations

import sys

from hybridflow.trainer.sft.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
