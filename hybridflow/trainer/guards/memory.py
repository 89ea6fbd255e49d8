"""The host-memory watch (issue 31): every worker process reports its peak RSS (and device peak) after each step;
the sum per node is held against a budget that warns at `warn_fraction` and stops the run, with a checkpoint, before
the kernel's OOM killer would take a worker, naming the process that grew and since which step."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

from hybridflow.trainer.guards.config import MemoryWatchConfig
from hybridflow.utils.process_memory import MemoryReport

logger = logging.getLogger(__name__)

GB = 1e9
MemoryLevel = Literal["ok", "warn", "stop"]


class MemoryBudgetError(RuntimeError):
    """A node's worker processes reached `trainer.guards.memory.host_memory_budget_gb`: the run stopped."""


def compute_memory_level(used_bytes: float, budget_bytes: float, warn_fraction: float) -> MemoryLevel:
    """`stop` at or past the budget, `warn` at or past `warn_fraction` of it, else `ok`."""
    if used_bytes >= budget_bytes:
        return "stop"
    return "warn" if used_bytes >= warn_fraction * budget_bytes else "ok"


def compute_growth(history: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """A process's growth: (step of its lowest peak before the last report, that peak, the last peak), from its
    `(step, peak_rss_bytes)` reports in order."""
    last_step, last = history[-1]
    earlier = history[:-1] or history
    low_step, low = min(earlier, key=lambda item: (item[1], item[0]))
    return low_step, low, last


class MemoryWatch:
    """Driver side: the reports of every worker process, step by step, and the budget check."""

    def __init__(self, config: MemoryWatchConfig) -> None:
        self.config = config
        self.history: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.reports: dict[tuple[str, int], MemoryReport] = {}
        self.warned: set[str] = set()

    def observe(self, step: int, pools: Sequence[Any]) -> tuple[dict[str, float], MemoryBudgetError | None]:
        """Collect this step's reports from `pools` (`WorkerProcesses`: a name and a `group` whose workers answer
        `memory_report`); the memory metrics and the error that stops the run, if a node is over its budget."""
        if not self.config.enable or not pools:
            return {}, None
        for processes in pools:
            for rank, report in enumerate(processes.group.memory_report()):
                key = (processes.name, rank)
                self.reports[key] = report
                self.history.setdefault(key, []).append((step, report.peak_rss_bytes))
        metrics: dict[str, float] = {}
        error = None
        for node, keys in self._by_node().items():
            used = sum(self.reports[key].peak_rss_bytes for key in keys)
            budget = self.budget_bytes(self.reports[keys[0]])
            metrics[f"memory/node_{node}/peak_rss_gb"] = used / GB
            metrics[f"memory/node_{node}/budget_used"] = used / budget
            level = compute_memory_level(used, budget, self.config.warn_fraction)
            if level == "warn" and node not in self.warned:
                self.warned.add(node)
                logger.warning("%s", self.describe(node, keys, used, budget, step, "warning"))
            elif level == "stop" and error is None:
                error = MemoryBudgetError(self.describe(node, keys, used, budget, step, "stop"))
        peaks = [report.peak_rss_bytes for report in self.reports.values()]
        metrics["memory/peak_rss_gb/max"] = max(peaks) / GB
        metrics["memory/rss_gb/max"] = max(report.rss_bytes for report in self.reports.values()) / GB
        device = [report.device_peak_bytes for report in self.reports.values() if report.device_peak_bytes]
        if device:
            metrics["memory/device_peak_gb/max"] = max(device) / GB
        return metrics, error

    def budget_bytes(self, report: MemoryReport) -> float:
        budget_gb = self.config.host_memory_budget_gb
        return budget_gb * GB if budget_gb is not None else 0.9 * report.node_total_bytes

    def _by_node(self) -> dict[str, list[tuple[str, int]]]:
        nodes: dict[str, list[tuple[str, int]]] = {}
        for key, report in self.reports.items():
            nodes.setdefault(report.node_ip, []).append(key)
        return nodes

    def describe(self, node: str, keys: list[tuple[str, int]], used: float, budget: float, step: int, level: str) -> str:
        """Which process grew the most and since when, and every process's peak on the node."""
        growths = {key: compute_growth(self.history[key]) for key in keys}
        (name, rank), (since, low, last) = max(growths.items(), key=lambda item: item[1][2] - item[1][1])
        pid = self.reports[(name, rank)].pid
        each = ", ".join(
            f"{group} rank {r} (pid {self.reports[(group, r)].pid}) {self.reports[(group, r)].peak_rss_bytes / GB:.2f}"
            for group, r in keys
        )
        head = (
            f"the run stopped after saving step {step}'s checkpoint: "
            if level == "stop" else f"{self.config.warn_fraction:.0%} of the memory budget reached: "
        )
        return (
            f"{head}node {node}: the worker processes' peak RSS sums to {used / GB:.2f} GB at step {step}, "
            f"{used / budget:.0%} of the budget {budget / GB:.2f} GB (trainer.guards.memory.host_memory_budget_gb). "
            f"Grew most: {name} rank {rank} (pid {pid}), from {low / GB:.2f} GB at step {since} to {last / GB:.2f} GB. "
            f"Peak RSS per process (GB): {each}. Check for tensors kept across steps (a leak), a larger batch or "
            "response length, or offload settings; raise the budget only if the node has the memory."
        )


def arm_within_step_watch(pools: Sequence[Any], config: MemoryWatchConfig, timeout_s: float = 120.0) -> int:
    """Arm the within-step watch (`utils.memory_watchdog`) in every Ray worker process of `pools`
    (`WorkerProcesses`), each with the pids of the run's worker processes on its node; the number armed. Local mode
    (workers in the driver) is not watched this way."""
    import ray

    from hybridflow.single_controller.ray import RayWorkerGroup

    if not (config.enable and config.within_step):
        return 0
    members = [
        (actor, info)
        for processes in pools if isinstance(processes.group, RayWorkerGroup)
        for actor, info in zip(processes.group.workers, processes.group.process_info or [], strict=True)
    ]
    by_node: dict[str, list[int]] = {}
    for _, info in members:
        by_node.setdefault(info.node_id, []).append(info.pid)
    if not members:  # local mode (no Ray actors): ray.get([]) would start a Ray instance of its own
        return 0
    handles = [
        actor.arm_memory_watchdog.remote(config.host_memory_budget_gb, by_node[info.node_id], config.poll_interval_s)
        for actor, info in members
    ]
    return sum(ray.get(handles, timeout=timeout_s))
