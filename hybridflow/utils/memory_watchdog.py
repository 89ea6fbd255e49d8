"""The memory budget within a step (issue 31): a thread in each worker process sums the resident memory of the
run's worker processes on its node every `interval_s` and, at the budget, stops the call of the largest one with
`WorkerMemoryBudgetError` naming every process, before the kernel's OOM killer would take one. The per-step watch
(`trainer.guards.memory`) sees growth across steps; this sees a single step that would not end.

The thread cannot raise in the main thread directly: it records the message and sends the process SIGUSR1, whose
handler (installed from the main thread when armed) raises the error there, between two Python operations. The
call fails like any raising call (the driver's `WorkerError` names the rank and carries the message); the worker
frees what the call held and stays up. A worker whose calls run on other threads (a threaded actor: the agent
loops' generation servers) cannot take a signal handler: there the watch logs the message and ends the process,
which the driver reports as a dead worker pointing to that log. Linux only (/proc).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

GB = 1e9
_PAGE = os.sysconf("SC_PAGE_SIZE")


class WorkerMemoryBudgetError(RuntimeError):
    """The run's worker processes on this node reached the memory budget during a call; this one was the largest."""


def resident_bytes(pid: int) -> int | None:
    """A process's resident set (bytes), or None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def node_budget_bytes(budget_gb: float | None) -> float:
    """`budget_gb` (1e9 bytes), or 90% of this node's physical memory when None (`host_memory_budget_gb`)."""
    return budget_gb * GB if budget_gb is not None else 0.9 * os.sysconf("SC_PHYS_PAGES") * _PAGE


def describe_over_budget(resident: dict[int, int], budget: float, me: int) -> str:
    """The stop message: the node's sum against the budget, and each process's resident set, largest first."""
    each = ", ".join(f"pid {pid} {size / GB:.2f} GB" for pid, size in sorted(resident.items(), key=lambda x: -x[1]))
    return (
        f"the run's worker processes on this node reached {sum(resident.values()) / GB:.2f} GB resident, the memory "
        f"budget of {budget / GB:.2f} GB (trainer.guards.memory.host_memory_budget_gb), during a call: this process "
        f"(pid {me}, the largest) stopped it before the OOM killer would stop one. Resident per process: {each}. "
        "Check the batch or response length, micro-batch sizes or offload settings; raise the budget only if the "
        "node has the memory"
    )


class MemoryWatchdog:
    """This process's watch over the node's worker processes (`pids`, this one included) against `budget_bytes`."""

    def __init__(self, budget_bytes: float, pids: Sequence[int], interval_s: float = 0.5) -> None:
        self.budget_bytes = budget_bytes
        self.pids = sorted(set(pids) | {os.getpid()})
        self.interval_s = interval_s
        self.message: str | None = None
        self.mode = "raise"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridflow-memory-watchdog", daemon=True)

    def start(self) -> str:
        """Start watching; returns how a call is stopped: `raise` (the SIGUSR1 handler, installed when called from
        the main thread) or `exit` (the process ends, from any other thread)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._raise_in_main_thread)
            self.mode = "raise"
        else:
            self.mode = "exit"
        self._thread.start()
        return self.mode

    def stop(self) -> None:
        self._stop.set()

    def check_once(self) -> bool:
        """Sum the node's resident sets; True (and the message recorded) when at the budget and this process is the
        largest, the one whose call must stop."""
        resident = {pid: size for pid in self.pids if (size := resident_bytes(pid)) is not None}
        if sum(resident.values()) < self.budget_bytes or max(resident, key=resident.get) != os.getpid():
            return False
        self.message = describe_over_budget(resident, self.budget_bytes, os.getpid())
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check_once():
                logger.error("%s", self.message)
                if self.mode == "exit":
                    print(f"hybridflow memory watch: {self.message}", file=sys.stderr, flush=True)
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGUSR1)
                self._stop.wait(10 * self.interval_s)  # let the call unwind and free its memory before looking again

    def _raise_in_main_thread(self, signum: int, frame: object) -> None:
        message, self.message = self.message, None
        if message is not None:
            raise WorkerMemoryBudgetError(message)
