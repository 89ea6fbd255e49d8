"""Every method the workers call on a training engine exists on `FSDPEngine`.

Some calls are reached only on an accelerator (the optimizer offload around `update_actor`, `_move` returns early on
CPU), so a renamed engine method can pass the whole CPU suite and fail on the first GPU run: it did once
(`load_to_device`, found by the 2026-11-27 H200 bundle). This reads the calls from the source instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridflow
from hybridflow.engines.training import FSDPEngine

CALLERS = Path(hybridflow.__file__).parent / "workers"


def _engine_calls(path: Path) -> set[tuple[str, int, str]]:
    """(file, line, method) of every `<...engine>.method(...)` call in `path`: the receiver is a name or an
    attribute ending in `engine` (`engine`, `self.engine`, `self.actor_engine`, ...)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
        if name.endswith("engine"):
            calls.add((path.name, node.lineno, node.func.attr))
    return calls


def test_every_engine_method_the_workers_call_exists():
    calls = set().union(*(_engine_calls(path) for path in CALLERS.rglob("*.py")))
    assert {method for _, _, method in calls} >= {"train_batch", "compute_log_prob", "offload_to_cpu",
                                                  "load_to_device"}, "the scan found the workers' engine calls"
    missing = sorted(f"{file}:{line} calls engine.{method}" for file, line, method in calls
                     if not callable(getattr(FSDPEngine, method, None)))
    assert not missing, f"FSDPEngine has no such method: {missing}"
