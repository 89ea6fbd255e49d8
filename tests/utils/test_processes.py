"""Helper processes are forked only from a process not connected to Ray."""

from __future__ import annotations

import subprocess
import sys

from hybridflow.utils import processes


def test_fork_becomes_a_fork_server_only_where_ray_is_connected(monkeypatch):
    monkeypatch.setattr(processes, "connected_to_ray", lambda: False)
    assert [processes.start_method(name) for name in ("fork", "forkserver", "spawn")] == ["fork", "forkserver", "spawn"]
    monkeypatch.setattr(processes, "connected_to_ray", lambda: True)
    assert [processes.start_method(name) for name in ("fork", "forkserver", "spawn")] == [
        "forkserver", "forkserver", "spawn"]


def test_asking_does_not_import_ray():
    code = "import sys\nfrom hybridflow.utils.processes import connected_to_ray\nprint(connected_to_ray(), 'ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False", "False"]
