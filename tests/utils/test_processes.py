"""Helper processes are forked only from a process not connected to Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow.utils import processes


def test_fork_becomes_a_fork_server_only_where_ray_is_connected(monkeypatch):
    methods = ("fork", "forkserver", "spawn")
    monkeypatch.setattr(processes, "connected_to_ray", lambda: False)
    assert [processes.start_method(name, "the workers") for name in methods] == ["fork", "forkserver", "spawn"]
    monkeypatch.setattr(processes, "connected_to_ray", lambda: True)
    assert [processes.start_method(name, "the workers") for name in methods] == ["forkserver", "forkserver", "spawn"]


def test_asking_does_not_import_ray():
    code = ("import sys\nfrom hybridflow.utils.processes import connected_to_ray\n"
            "print(connected_to_ray(), 'ray' in sys.modules)")
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


def _main_script(monkeypatch, tmp_path, text):
    import types

    path = tmp_path / "train.py"
    path.write_text(text)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return str(path)


def test_an_unguarded_main_script_is_refused_before_a_fork_server_would_rerun_it(monkeypatch, tmp_path):
    from hybridflow.rewards import ScorerPool, ScoringConfig

    script = _main_script(monkeypatch, tmp_path, "from hybridflow.trainer.run import run_ppo\nrun_ppo(None, {})\n")
    assert processes.unguarded_main_script() == script
    processes.check_main_reimport("fork", "the workers")  # forked: nothing re-imported
    pool = ScorerPool(ScoringConfig(mp_context="forkserver", num_workers=1))
    with pytest.raises(RuntimeError, match=r"re-imports the main script .*train.py; it has no `if __name__"):
        pool.run([(dict, {"a": 1})])
    guarded = "import sys\n\ndef main():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n"
    _main_script(monkeypatch, tmp_path, guarded)
    assert processes.unguarded_main_script() is None
    monkeypatch.setitem(sys.modules, "__main__", type(sys)("__main__"))  # python -c, a notebook: no script
    assert processes.unguarded_main_script() is None
