"""verl's module name for checkpoint export: `python -m hybridflow.model_merger merge --backend fsdp --local_dir
global_step_N/actor --target_dir DIR` runs `hybridflow merge` (`hybridflow.engines.training.merge`)."""

from __future__ import annotations

import sys

from hybridflow.engines.training.merge import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
