"""verl's other one-step off-policy entry point (`python -m verl.experimental.one_step_off_policy.async_main_ppo`)
with the module name changed: the same trainer as `main_ppo` beside it."""

from __future__ import annotations

import sys

from hybridflow.experimental.one_step_off_policy.main_ppo import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
