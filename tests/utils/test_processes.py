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


def test_fork_server_preloads_add_up_instead_of_replacing_each_other(monkeypatch):
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    given = []
    monkeypatch.setattr(processes, "_FORK_SERVER_PRELOAD", [])
    monkeypatch.setattr(context, "set_forkserver_preload", given.append)
    assert processes.add_fork_server_preload(["torch", "transformers"]) == ["torch", "transformers"]
    assert processes.add_fork_server_preload(["hybridflow.rewards.score", "torch"]) == [
        "torch", "transformers", "hybridflow.rewards.score"]
    assert given[-1] == ["torch", "transformers", "hybridflow.rewards.score"]  # what the server imports
