"""Guards that make a run's silent failures loud (issue 31), checked by the driver after every step.

`trainer.guards.alarms` watches the step's metrics (log-prob mismatch, entropy collapse, length saturation, reward
flatlines, zero-advantage groups); `trainer.guards.versions` checks that each on-policy step's samples come from
the actor's latest weights; `trainer.guards.memory` holds the worker processes' memory against a budget.
A hung call's stacks are the worker group's job (`single_controller.ray.hang_stacks`). `StepGuards.check` returns
the error that must stop the run; the trainer saves the step's checkpoint first, then raises it.
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config schema imports
# `guards.config` without torch).
_EXPORTS = {
    "AlarmError": "alarms",
    "AlarmsConfig": "config",
    "GuardsConfig": "config",
    "MemoryBudgetError": "memory",
    "MemoryWatchConfig": "config",
    "StaleWeightsError": "versions",
    "StepGuards": "step",
    "WEIGHT_VERSION_KEY": "versions",
    "WeightVersionWatch": "versions",
    "check_served_version": "versions",
    "served_versions": "versions",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
