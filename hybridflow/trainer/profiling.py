"""The trainer side of profiling (`global_profiler` and each role's `profiler`): which processes record which steps.

Each pool's processes host several roles; a process records when one of its roles enables profiling and its rank
is among that role's ranks (`RoleProfilerConfig.ranks_of`). A trace covers a profiled step from before its
generation to after its update (validation and checkpoints are outside it), or a run of consecutive steps with
`global_profiler.profile_continuous_steps`. The worker side is `hybridflow.utils.step_profiler`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.trainer.config.profiler_checks import role_profilers
from hybridflow.utils.step_profiler import ProfileRequest

logger = logging.getLogger(__name__)


def pool_request(config: Any, roles: Sequence[str], pool_size: int, label: str) -> ProfileRequest | None:
    """What the processes of a pool hosting `roles` record at a profiled step (None: none of them records); the
    request's directory is filled in per step."""
    profilers = role_profilers(config)
    enabled = [profilers[role] for role in roles if role in profilers and profilers[role].enable]
    ranks = sorted(rank for rank in set().union(*(p.ranks_of(pool_size) for p in enabled)) if rank < pool_size)
    if not ranks:
        return None
    memory = config.global_profiler.global_tool_config.torch_memory
    return ProfileRequest(
        tool=config.global_profiler.tool,
        ranks=ranks,
        directory="",
        label=label,
        contents=sorted(set().union(*(profiler.tool_config.torch.contents for profiler in enabled))),
        memory_history={
            "max_entries": max(profiler.tool_config.torch_memory.trace_alloc_max_entries for profiler in enabled),
            "context": memory.context,
            "stacks": memory.stacks,
            **memory.kw_args,
        },
    )


class StepProfiling:
    """Starts the pools' recordings before each profiled step (or run of steps) and collects their files after it."""

    def __init__(self, config: Any, pools: Sequence[Any]) -> None:
        """pools: the run's `WorkerProcesses` (each with its `roles` and `group`)."""
        profiler = config.global_profiler
        self.runs = profiler.step_runs() if profiler.profiles else []
        self.save_path = Path(profiler.save_path).expanduser().resolve()
        self.requests = []
        for pool in pools if self.runs else []:
            label = pool.name.removeprefix("hybridflow_")
            request = pool_request(config, pool.roles, pool.group.world_size, label)
            if request is not None:
                self.requests.append((pool, request))
        self.recording: tuple[int, int] | None = None
        if self.runs:
            logger.info("profiling (%s) steps %s: %s, into %s", profiler.tool, profiler.steps,
                        ", ".join(f"{r.label} ranks {r.ranks}" for _, r in self.requests), self.save_path)

    def begin(self, step: int) -> None:
        """Before `step`: start the recordings if a profiled run of steps starts here."""
        run = next((run for run in self.runs if run[0] == step), None)
        if run is None or self.recording is not None:
            return
        name = f"step{run[0]}" if run[0] == run[1] else f"steps{run[0]}-{run[1]}"
        for pool, request in self.requests:
            pool.group.start_profile(_with_directory(request, self.save_path / name))
        self.recording = run

    def end(self, step: int, is_last: bool = False) -> dict[str, float]:
        """After `step`: stop the recordings if their run of steps ends here (or the training does); the number
        of files written (`profile/files`)."""
        if self.recording is None or (self.recording[1] != step and not is_last):
            return {}
        files = [path for pool, _ in self.requests for paths in pool.group.stop_profile() for path in paths]
        self.recording = None
        logger.info("profile of step %d written: %s", step, ", ".join(files))
        return {"profile/files": float(len(files))}

    def warn_unreached(self, total_steps: int) -> None:
        """Profiled steps beyond the run's last step are never recorded: say so once, at the start."""
        unreached = [first for first, _ in self.runs if first > total_steps]
        if unreached:
            logger.warning("global_profiler.steps %s lie beyond the run's %d steps: they are not profiled",
                           unreached, total_steps)


def _with_directory(request: ProfileRequest, directory: Path) -> ProfileRequest:
    from dataclasses import replace

    return replace(request, directory=str(directory))
