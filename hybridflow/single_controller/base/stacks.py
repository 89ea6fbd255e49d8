"""Python stacks of worker processes on demand, so a hung call explains itself (issue 31).

Each worker process registers `faulthandler` on `STACK_SIGNAL` at start (`install_stack_dump`): the C-level signal
handler writes every thread's Python stack to a per-process file even while the main thread is blocked inside C
(a gloo barrier, a sleep, a lock). `read_stacks` sends the signal to a pid on this node and returns what the handler
wrote. The worker group runs it on the hung process's node when a call or heartbeat times out
(`single_controller.ray.hang_stacks`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import IO

# SIGUSR2: neither Ray's workers nor torch use it in a worker process (torch elastic's launcher does, not its children).
STACK_SIGNAL = signal.SIGUSR2
_STACK_FILE: IO[str] | None = None  # kept open for the C handler, for the life of the process


def stack_file(pid: int) -> Path:
    """Where process `pid`'s stacks are written (node-local temp dir)."""
    return Path(tempfile.gettempdir()) / "hybridflow_stacks" / f"{pid}.txt"


def install_stack_dump() -> Path:
    """Make `STACK_SIGNAL` dump all threads' Python stacks of this process to `stack_file(os.getpid())`; once."""
    global _STACK_FILE
    path = stack_file(os.getpid())
    if _STACK_FILE is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _STACK_FILE = open(path, "a", encoding="utf-8")  # noqa: SIM115  (the handler writes into it later)
        faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True, chain=False)
    return path


def read_stacks(pid: int, wait_s: float = 3.0) -> str:
    """Signal `pid` (a process of this node that ran `install_stack_dump`) and return the stacks it wrote, or a line
    saying why there are none (no such process, no handler installed, no answer within `wait_s`)."""
    path = stack_file(pid)
    if not path.exists():
        return f"(no stack dump handler in pid {pid}: {path} does not exist)"
    before = path.stat().st_size
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return f"(pid {pid} is gone)"
    deadline = time.monotonic() + wait_s
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = path.stat().st_size
        if now > before and now == size:  # written and no longer growing
            break
        size = now
    with open(path, encoding="utf-8", errors="replace") as handle:
        handle.seek(before)
        text = handle.read()
    return text or f"(pid {pid} wrote no stacks within {wait_s:g} s)"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def innermost_frames(stacks: str, count: int = 4) -> list[str]:
    """The `count` innermost frames, as `func (file:line)`, of the thread that runs the worker's calls in a
    faulthandler dump: a Ray worker's main thread (its stack starts in default_worker.py), else the signalled
    thread, else the last one listed (faulthandler lists the main thread last)."""
    blocks = [block for block in stacks.strip().split("\n\n") if _FRAME.search(block)]
    if not blocks:
        return []
    chosen = next((block for block in blocks if "default_worker.py" in block), None)
    chosen = chosen or next((block for block in blocks if block.startswith("Current thread")), blocks[-1])
    frames = [_FRAME.search(line) for line in chosen.splitlines()]
    return [f"{m['func']} ({Path(m['file']).name}:{m['line']})" for m in frames if m][:count]
