"""When a worker-group call or heartbeat times out: every rank's Python stacks, written beside the error (issue 31).

Processes on the driver's node are signalled from the driver; those on other nodes by a zero-CPU Ray task pinned
to their node. The full dumps go to a file (`hang_stacks_<group>_<method>_<time>.txt` in the group's
`stack_dump_dir`, the run directory for trainers); the error message names the file and gives each rank's
innermost frames.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # the Ray worker group imports this module; local mode runs without Ray
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:
    ray = None

from hybridflow.single_controller.base.stacks import innermost_frames, read_stacks
from hybridflow.single_controller.base.worker import ProcessInfo

logger = logging.getLogger(__name__)

# Bounds what a timeout adds before it raises: the signal handlers answer in milliseconds, a remote node's task
# needs a worker process.
LOCAL_WAIT_S = 2.0
REMOTE_WAIT_S = 15.0


def _read_stacks_on_node(pid: int) -> str:
    return read_stacks(pid, LOCAL_WAIT_S)


def collect_stacks(process_info: list[ProcessInfo]) -> list[str]:
    """Each rank's stacks (all threads), in rank order; a line saying why where a rank gave none."""
    here = ray.get_runtime_context().get_node_id()
    remote = {
        rank: ray.remote(_read_stacks_on_node).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(process.node_id, soft=False)
        ).remote(process.pid)
        for rank, process in enumerate(process_info) if process.node_id != here
    }
    with ThreadPoolExecutor(max_workers=max(1, len(process_info))) as pool:
        local = {
            rank: pool.submit(read_stacks, process.pid, LOCAL_WAIT_S)
            for rank, process in enumerate(process_info) if process.node_id == here
        }
        stacks = {rank: future.result() for rank, future in local.items()}
    if remote:
        ready, _ = ray.wait(list(remote.values()), num_returns=len(remote), timeout=REMOTE_WAIT_S)
        for rank, ref in remote.items():
            stacks[rank] = ray.get(ref) if ref in ready else f"(node of rank {rank} gave no stacks in {REMOTE_WAIT_S:g} s)"
    return [stacks[rank] for rank in range(len(process_info))]


def write_hang_report(
    directory: Path, group: str, method: str, process_info: list[ProcessInfo], missing: list[int]
) -> tuple[Path, str]:
    """Collect every rank's stacks into a file in `directory`; the file and a summary for the error message (the
    innermost frames of each rank that did not answer)."""
    stacks = collect_stacks(process_info)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"hang_stacks_{group}_{method}_{time.strftime('%Y%m%d-%H%M%S')}.txt"
    sections = [
        f"===== rank {rank} (pid {process.pid} on {process.node_ip}){' did not answer' if rank in missing else ''}\n"
        f"{text.rstrip()}\n"
        for rank, (process, text) in enumerate(zip(process_info, stacks))
    ]
    path.write_text(f"worker group {group!r}, call {method!r}: Python stacks of every rank\n\n" + "\n".join(sections))
    lines = [
        f"  rank {rank}: {' <- '.join(innermost_frames(stacks[rank])) or stacks[rank].strip()[:200]}"
        for rank in missing
    ]
    summary = f"Where each rank waits (innermost frame first; all threads in {path}):\n" + "\n".join(lines)
    return path, summary
