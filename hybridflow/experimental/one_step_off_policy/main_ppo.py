"""verl's one-step off-policy entry point (`python -m verl.experimental.one_step_off_policy.main_ppo`) with the module
name changed: runs `hybridflow train-one-step-off` (`hybridflow.trainer.off_policy.main_one_step_off`)."""

from __future__ import annotations

import sys

from hybridflow.trainer.off_policy.main_one_step_off import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
