"""verl's fully async entry point (`python -m verl.experimental.fully_async_policy.fully_async_main`) with the module
name changed: runs `hybridflow train-fully-async` (`hybridflow.trainer.off_policy.main_fully_async`)."""

from __future__ import annotations

import sys

from hybridflow.trainer.off_policy.main_fully_async import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
