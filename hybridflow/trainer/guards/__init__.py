"""Guards that make a run's silent failures loud (issue 31), checked by the driver after every step.

`trainer.guards.alarms` watches the step's metrics (log-prob mismatch, entropy collapse, length saturation, reward
flatlines, zero-advantage groups); `trainer.guards.memory` holds the worker processes' memory against a budget.
A hung call's stacks are the worker group's job (`single_controller.ray.hang_stacks`). `StepGuards.check` returns
the error that must stop the run; the trainer saves the step's checkpoint first, then raises it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.trainer.guards.alarms import AlarmError, AlarmMonitor, AlarmsConfig, compute_group_metrics
from hybridflow.trainer.guards.memory import MemoryBudgetError, MemoryWatch, MemoryWatchConfig

__all__ = ["AlarmError", "AlarmsConfig", "GuardsConfig", "MemoryBudgetError", "MemoryWatchConfig", "StepGuards"]


@dataclass(frozen=True, kw_only=True)
class GuardsConfig:
    """trainer.guards: checks after every step that stop a run from failing silently."""

    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    """Alarms on the step's metrics."""
    memory: MemoryWatchConfig = field(default_factory=MemoryWatchConfig)
    """The worker processes' host-memory budget."""


class StepGuards:
    """The driver's guards for one run: alarm history and memory reports."""

    def __init__(self, config: GuardsConfig) -> None:
        self.alarms = AlarmMonitor(config.alarms)
        self.memory = MemoryWatch(config.memory)

    def check(
        self, step: int, batch: DataProto, metrics: dict[str, float], processes: Sequence[Any]
    ) -> RuntimeError | None:
        """Add the guards' metrics to `metrics` (group reward metrics, `alarms/*`, `memory/*` of the idle worker
        `processes`); the error that must stop the run after this step's checkpoint, or None."""
        if "uid" in batch.non_tensor_batch:
            metrics.update(compute_group_metrics(dict(batch.batch.items()), batch.non_tensor_batch["uid"].tolist()))
        firing = self.alarms.observe(step, metrics)
        memory_metrics, memory_error = self.memory.observe(step, processes)
        metrics.update(memory_metrics)
        return memory_error or self.alarms.stop_error(step, firing)
