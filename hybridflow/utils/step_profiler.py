"""The worker side of profiling (`global_profiler`): what one process records over a profiled step, and where it
writes it. The trainer (`hybridflow.trainer.profiling`) sends a `ProfileRequest` to every process of a pool at
the start of a profiled step (or run of steps) and asks for the files at its end."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TOP_OPS = 30
"""Rows of the op table written beside each trace."""


@dataclass(frozen=True)
class ProfileRequest:
    """What the processes of one pool record from `start_profile` to `stop_profile`."""

    tool: str
    """torch | torch_memory."""
    ranks: list[int]
    """The pool's ranks that record; the others do nothing."""
    directory: str
    """Where the files go (absolute), e.g. `<save_path>/step3`."""
    label: str
    """The pool's name, first part of each file name."""
    contents: list[str] = field(default_factory=list)
    """torch: cuda, cpu, memory, shapes, stack (empty: the CPU, and CUDA on a CUDA device)."""
    memory_history: dict[str, Any] = field(default_factory=dict)
    """torch_memory: keyword arguments of `torch.cuda.memory._record_memory_history`."""


class StepProfiler:
    """One process's recording for one request: `start()`, the step's work, `stop()` -> the files written."""

    def __init__(self, request: ProfileRequest, rank: int, device: torch.device) -> None:
        self.request, self.rank, self.device = request, rank, device
        self.stem = Path(request.directory) / f"{request.label}_rank{rank}"
        self._profile: torch.profiler.profile | None = None
        if request.tool == "torch_memory" and device.type != "cuda":
            raise RuntimeError(
                f"global_profiler.tool=torch_memory records CUDA allocations, but rank {rank} of {request.label} runs "
                f"on {device.type}; use global_profiler.tool=torch"
            )

    def start(self) -> None:
        if self.request.tool == "torch_memory":
            torch.cuda.memory._record_memory_history(**self.request.memory_history)
            return
        self._profile = torch.profiler.profile(**profile_options(self.request.contents, self.device))
        self._profile.start()

    def stop(self) -> list[str]:
        """End the recording and write its files; their paths."""
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        if self.request.tool == "torch_memory":
            snapshot = self.stem.with_suffix(".pickle")
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            return [str(snapshot)]
        assert self._profile is not None, "stop() before start()"
        self._profile.stop()
        trace = self.stem.with_suffix(".json")
        self._profile.export_chrome_trace(str(trace))
        table = self.stem.with_suffix(".txt")
        on_cuda = any(activity == torch.profiler.ProfilerActivity.CUDA for activity in self._profile.activities)
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        table.write_text(self._profile.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS) + "\n")
        return [str(trace), str(table)]


def profile_options(contents: list[str], device: torch.device) -> dict[str, Any]:
    """`torch.profiler.profile` arguments for verl's `tool_config.torch.contents` on `device`."""
    from torch.profiler import ProfilerActivity

    wanted = set(contents)
    activities = []
    if not wanted & {"cpu", "cuda"} or "cpu" in wanted:
        activities.append(ProfilerActivity.CPU)
    if ("cuda" in wanted or not wanted & {"cpu", "cuda"}) and device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    if not activities:  # only cuda asked, on a CPU worker
        raise RuntimeError(
            f"profiler contents {contents} ask for CUDA activity on a {device.type} worker; add cpu or leave contents "
            "empty"
        )
    return {
        "activities": activities,
        "record_shapes": "shapes" in wanted,
        "profile_memory": "memory" in wanted,
        "with_stack": "stack" in wanted,
    }
