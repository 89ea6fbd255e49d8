"""Finding and configuring the sandbox's memory cgroup, on fake cgroup trees (v2 delegated, v1, none), so every
kind of host is covered whatever this machine has. `test_isolation.py` checks the real cap where one exists."""

from __future__ import annotations

import logging

import pytest

from hybridflow.sandbox import _cgroup


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """(write(mountinfo, cgroup) -> None, root): point the module at fake /proc/self files."""
    proc = tmp_path / "proc"
    proc.mkdir()
    monkeypatch.setattr(_cgroup, "PROC_SELF_MOUNTINFO", str(proc / "mountinfo"))
    monkeypatch.setattr(_cgroup, "PROC_SELF_CGROUP", str(proc / "cgroup"))
    _cgroup.reset_for_tests()
    yield tmp_path
    _cgroup.reset_for_tests()  # the real tree is found again by the next real run


def write_host(tmp_path, mountinfo: str, cgroup: str) -> None:
    (tmp_path / "proc" / "mountinfo").write_text(mountinfo)
    (tmp_path / "proc" / "cgroup").write_text(cgroup)


def test_cgroup_v2_with_the_memory_controller_delegated(fake_host):
    mount = fake_host / "cgroup2"
    ours = mount / "user.slice" / "trainer"
    ours.mkdir(parents=True)
    (ours / "cgroup.controllers").write_text("cpu memory pids\n")
    (ours / "cgroup.subtree_control").write_text("memory pids\n")
    write_host(fake_host, f"30 25 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n", "0::/user.slice/trainer\n")
    cgroup = _cgroup.create_cgroup(100 << 20, 8)
    assert cgroup is not None and cgroup.version == 2 and cgroup.path.startswith(str(ours) + "/hybridflow-sandbox-")
    assert (fake_host / cgroup.path / "memory.max").read_text() == str(100 << 20)
    assert cgroup.oom_kills() == 0
    (fake_host / cgroup.path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert cgroup.oom_kills() == 1
    assert _cgroup.describe_cgroup_support() == f"cgroup v2 at {ours}"


def test_cgroup_v2_beside_the_trainer_in_a_delegated_slice(fake_host):
    mount = fake_host / "cgroup2"
    slice_, ours = mount / "app.slice", mount / "app.slice" / "trainer.scope"
    ours.mkdir(parents=True)
    (ours / "cgroup.controllers").write_text("memory pids\n")
    (ours / "cgroup.subtree_control").write_text("\n")  # holds the trainer: no controllers for children
    (slice_ / "cgroup.subtree_control").write_text("memory pids\n")
    write_host(fake_host, f"30 25 0:26 / {mount} rw - cgroup2 cgroup2 rw\n", "0::/app.slice/trainer.scope\n")
    cgroup = _cgroup.create_cgroup(10 << 20, 2)
    assert cgroup is not None and cgroup.path.startswith(str(slice_) + "/hybridflow-sandbox-")


def test_cgroup_v1_memory_hierarchy(fake_host):
    mount = fake_host / "memory"
    ours = mount / "jobs" / "42"
    ours.mkdir(parents=True)
    (ours / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    mountinfo = (f"30 25 0:26 / {fake_host}/unified rw - cgroup2 cgroup2 rw\n"
                 f"31 25 0:27 / {mount} rw,nosuid - cgroup cgroup rw,memory\n")
    write_host(fake_host, mountinfo, "4:memory:/jobs/42\n1:cpu:/\n0::/\n")
    cgroup = _cgroup.create_cgroup(64 << 20, 4)
    assert cgroup is not None and cgroup.version == 1
    assert (fake_host / cgroup.path / "memory.limit_in_bytes").read_text() == str(64 << 20)
    (fake_host / cgroup.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroup.oom_kills() == 2


def test_no_memory_controller_warns_once_and_runs_on_rlimits(fake_host, caplog):
    mount = fake_host / "cgroup2"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpu pids\n")
    (mount / "cgroup.subtree_control").write_text("cpu pids\n")
    write_host(fake_host, f"30 25 0:26 / {mount} rw - cgroup2 cgroup2 rw\n", "0::/\n")
    with caplog.at_level(logging.WARNING, logger="hybridflow.sandbox._cgroup"):
        assert _cgroup.create_cgroup(1 << 20, 1) is None
        assert _cgroup.create_cgroup(1 << 20, 1) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "memory controller" in warnings[0] and "memory_mb x max_processes" in warnings[0]
    assert _cgroup.describe_cgroup_support().startswith("none (")
