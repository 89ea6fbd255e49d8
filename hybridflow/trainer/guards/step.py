"""`StepGuards`: the driver's guards for one run, checked after every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.trainer.guards.alarms import AlarmMonitor, compute_group_metrics
from hybridflow.trainer.guards.config import GuardsConfig
from hybridflow.trainer.guards.memory import MemoryWatch

__all__ = ["StepGuards"]


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
