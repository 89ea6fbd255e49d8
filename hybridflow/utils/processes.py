"""How helper processes start: forked where that is safe, never from a process connected to Ray.

Ray does not support forking a process connected to it: the child inherits Ray's gRPC state, and a fork can
leave the parent's later calls to Ray's control store hanging (seen with the scorer pool of a run judged by a
generative reward model: the run's final `remove_placement_group` never returned). A process that would fork
its helpers starts them from a fork server instead there: a clean interpreter that forks each helper."""

from __future__ import annotations

import ast
import multiprocessing
import sys
from collections.abc import Iterable

__all__ = ["add_fork_server_preload", "check_main_reimport", "connected_to_ray", "start_method"]

_FORK_SERVER_PRELOAD: list[str] = []
"""Every module asked for so far: the fork server is one per process and imports them when it starts."""


def connected_to_ray() -> bool:
    """Whether this process is connected to Ray (looked up, not imported: Ray is not needed to ask)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def start_method(preferred: str, purpose: str) -> str:
    """How `purpose`'s processes start: `preferred` ('fork', 'forkserver' or 'spawn'), with 'fork' replaced by
    'forkserver' in a process connected to Ray; a start that re-imports an unguarded main script is refused
    (`check_main_reimport`)."""
    method = "forkserver" if preferred == "fork" and connected_to_ray() else preferred
    check_main_reimport(method, purpose)
    return method


def add_fork_server_preload(modules: Iterable[str]) -> list[str]:
    """Have this process's fork server import `modules` too when it starts (no effect once it runs); returns the
    whole list. Callers add rather than replace (multiprocessing's own setter replaces), so the scorer pool and
    other users of the one fork server keep each other's modules."""
    for module in modules:
        if module not in _FORK_SERVER_PRELOAD:
            _FORK_SERVER_PRELOAD.append(module)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
    return list(_FORK_SERVER_PRELOAD)


def unguarded_main_script() -> str | None:
    """The main script's path if it has no top-level `if __name__ == "__main__":` block, else None (also for an
    interactive session or `python -c`, which have no script). A process started from a fork server or by spawn
    re-imports the main script, so an unguarded one would run again in every such process."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None  # not readable as Python source here: nothing to tell
    return None if any(_is_main_guard(node) for node in tree.body) else path


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    values = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"] and isinstance(node.test.ops[0], ast.Eq)


def check_main_reimport(method: str, purpose: str) -> None:
    """Refuse to start `purpose`'s processes by fork server or spawn from an unguarded main script (see
    `unguarded_main_script`): each of them would run the script again."""
    if method == "fork":
        return
    script = unguarded_main_script()
    if script is not None:
        reason = "this process is connected to Ray, so " if connected_to_ray() else ""
        raise RuntimeError(
            f"{reason}{purpose} start from a fork server ('{method}'), which re-imports the main script {script}; it "
            "has no `if __name__ == \"__main__\":` block, so each of them would run it again: put what the script "
            "runs under that block"
        )
