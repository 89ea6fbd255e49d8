"""verl's Ray launcher of engine SFT: `python -m hybridflow.trainer.sft_trainer_ray trainer.nnodes=1
trainer.n_gpus_per_node=N <verl's sft_trainer_engine keys>`. hybridflow's SFT driver always places its workers on
Ray, so this is `hybridflow.trainer.sft_trainer` run from one process."""

from __future__ import annotations

import sys

from hybridflow.trainer.sft_trainer import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
