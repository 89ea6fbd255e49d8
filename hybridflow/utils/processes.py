"""How helper processes start: forked where that is safe, never from a process connected to Ray.

Ray does not support forking a process connected to it: the child inherits Ray's gRPC state, and a fork can
leave the parent's later calls to Ray's control store hanging (seen with the scorer pool of a run judged by a
generative reward model: the run's final `remove_placement_group` never returned). A process that would fork
its helpers starts them from a fork server instead there: a clean interpreter that forks each helper."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterable

__all__ = ["add_fork_server_preload", "connected_to_ray", "start_method"]

_FORK_SERVER_PRELOAD: list[str] = []
"""Every module asked for so far: the fork server is one per process and imports them when it starts."""


def connected_to_ray() -> bool:
    """Whether this process is connected to Ray (looked up, not imported: Ray is not needed to ask)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def start_method(preferred: str) -> str:
    """`preferred` ('fork', 'forkserver' or 'spawn'), with 'fork' replaced by 'forkserver' in a process connected
    to Ray."""
    return "forkserver" if preferred == "fork" and connected_to_ray() else preferred


def add_fork_server_preload(modules: Iterable[str]) -> list[str]:
    """Have this process's fork server import `modules` too when it starts (no effect once it runs); returns the
    whole list. Callers add rather than replace (multiprocessing's own setter replaces), so the scorer pool and
    other users of the one fork server keep each other's modules."""
    for module in modules:
        if module not in _FORK_SERVER_PRELOAD:
            _FORK_SERVER_PRELOAD.append(module)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
    return list(_FORK_SERVER_PRELOAD)
