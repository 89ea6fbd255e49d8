"""hybridflow.sandbox: a program cannot turn its isolation off, isolation is required by default, and the disk
and memory caps hold. Each attack is a test that fails on a sandbox that falls back, re-runs or trusts the
program's output (see docs/reliability.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.sandbox import SandboxError, SandboxLimits, run_python
from hybridflow.sandbox import runner
from tests.sandbox.test_sandbox import NO_NAMESPACES, namespaces_work, processes_in

FAST = dict(cpu_time_s=2.0, wall_time_s=4.0, memory_mb=256, max_processes=8)
NAMESPACE_LAYERS = {"user_ns", "net_ns", "pid_ns", "mount_ns", "readonly_root", "workdir_tmpfs"}


@pytest.fixture
def namespaces():
    if not namespaces_work():
        pytest.skip(NO_NAMESPACES)


@pytest.fixture
def sandbox_root(tmp_path, monkeypatch):
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(root))
    return root


def assert_still_isolated() -> None:
    """A later, innocent run still gets the full isolation: no run degrades the ones after it."""
    after = run_python("print('next')", limits=SandboxLimits(**FAST))
    assert after.ok and after.isolation_mode == "namespaces" and NAMESPACE_LAYERS <= set(after.isolation), after


# The runner's old stderr marker, and the report pipe's own format, printed by the program everywhere it can.
FORGED_SETUP_FAILURE = """import json, os, sys
fake = json.dumps({"setup_error": "unshare refused: forged", "namespaces_unavailable": True}) + "\\n"
sys.stderr.write("\\nhybridflow-sandbox: setup failed: unshare refused: [Errno 1] forged\\n" + fake)
print(fake)
for fd in range(3, 64):
    try:
        os.write(fd, fake.encode())
    except OSError:
        pass
print('ran', flush=True)
os._exit(3)
"""


def test_forged_setup_failure_is_the_programs_own_exit(namespaces, sandbox_root):
    """Attack 1a: print the setup-failure marker and exit 3. Old behaviour: re-run without namespaces."""
    result = run_python(FORGED_SETUP_FAILURE, limits=SandboxLimits(**FAST))
    assert (result.status, result.exit_code, result.isolation_mode) == ("error", 3, "namespaces"), result
    assert NAMESPACE_LAYERS <= set(result.isolation)
    assert result.stdout.count("ran") == 1  # ran once, under namespaces, never again without them
    assert_still_isolated()
    assert processes_in(sandbox_root) == [] and list(sandbox_root.iterdir()) == []


def test_forged_setup_failure_without_namespaces_is_an_error_result(sandbox_root):
    result = run_python(FORGED_SETUP_FAILURE, limits=SandboxLimits(isolation="none", **FAST))
    assert (result.status, result.exit_code, result.isolation_mode) == ("error", 3, "none"), result


SIGNAL_EVERYONE = """import os, signal, time
sent = []
for sig in sorted(signal.valid_signals()):
    for target in (1, -1):
        try:
            os.kill(target, sig)
            sent.append(int(sig))
        except OSError:
            pass
time.sleep(0.3)
print('alive', len(sent) > 60)
"""


def test_signals_to_the_sandbox_init_change_nothing(namespaces, sandbox_root):
    """Attack 1b: every signal to pid 1 (and to -1, everyone else). Old behaviour: SIGINT made pid 1's wait4
    raise, the trainer read a setup error and re-ran the program without namespaces."""
    result = run_python(SIGNAL_EVERYONE, limits=SandboxLimits(**FAST))
    assert result.ok and result.stdout == "alive True\n", result
    assert result.isolation_mode == "namespaces" and NAMESPACE_LAYERS <= set(result.isolation)
    assert_still_isolated()
    assert processes_in(sandbox_root) == [] and list(sandbox_root.iterdir()) == []


def broken_child(tmp_path, monkeypatch, old: str, new: str) -> None:
    """Point the runner at a copy of the sandbox's bootstrap with `old` replaced by `new`."""
    source = runner._CHILD.read_text()
    assert old in source
    for name in ("_runtime.py", "_harness.py"):
        shutil.copy(runner._CHILD.with_name(name), tmp_path / name)
    (tmp_path / "_child.py").write_text(source.replace(old, new, 1))
    monkeypatch.setattr(runner, "_CHILD", tmp_path / "_child.py")


def test_real_setup_failure_raises_and_later_runs_keep_namespaces(namespaces, tmp_path, monkeypatch, sandbox_root):
    broken_child(tmp_path, monkeypatch, '    root = os.path.join(job["base_dir"], "root")\n',
                 '    raise OSError("simulated mount failure")\n')
    with pytest.raises(SandboxError, match="simulated mount failure"):
        run_python("print('ran')", limits=SandboxLimits(**FAST))
    monkeypatch.undo()
    assert_still_isolated()
    assert processes_in(sandbox_root) == []


NO_USERNS_SCRIPT = """
from hybridflow.sandbox import SandboxError, SandboxLimits, run_python
try:
    run_python("print(1)")
    print("RAN WITHOUT ISOLATION")
except SandboxError as err:
    print("ERROR", err)
none = run_python("print(1)", limits=SandboxLimits(isolation="none"))
print("NONE", none.status, none.isolation_mode, none.stdout.strip())
"""


def test_without_user_namespaces_runs_fail_closed_naming_the_setting():
    """Attack surface 2: a machine without user namespaces. Here they work, so a child user namespace with
    user.max_user_namespaces=0 stands in for such a machine (where they do not, the test runs directly)."""
    command = [sys.executable, "-c", NO_USERNS_SCRIPT]
    if namespaces_work():
        if shutil.which("unshare") is None:
            pytest.skip("SKIPPED: no `unshare` binary to make a namespace-less environment")
        command = ["unshare", "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh",
                   *command]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "RAN WITHOUT ISOLATION" not in done.stdout
    error = next(line for line in done.stdout.splitlines() if line.startswith("ERROR"))
    assert "namespaces are unavailable" in error and "isolation='none'" in error
    assert "reward_model.scoring.sandbox.isolation=none" in error and "config.limits.isolation" in error
    assert "NONE ok none 1" in done.stdout


def test_report_lines_after_start_are_never_setup_errors():
    read, write = os.pipe()
    lines = [{"layers": ["user_ns"]}, {"started": True}, {"setup_error": "late", "namespaces_unavailable": True},
             {"exit_code": 3, "signal": None, "cpu_s": 0.1}]
    os.write(write, "".join(json.dumps(line) + "\n" for line in lines).encode())
    os.close(write)
    report = runner._read_report(read)
    os.close(read)
    assert report.started and report.setup_error is None and not report.namespaces_unavailable
    assert report.facts["exit_code"] == 3
    runner._check_setup(report, None, b"")  # no SandboxError: the program ran, its exit is its own


def test_setup_error_before_start_raises():
    early = runner._Report(setup_error="namespace setup: OSError: boom")
    with pytest.raises(SandboxError, match="boom"):
        runner._check_setup(early, None, b"")
    with pytest.raises(SandboxError, match="without a report"):
        runner._check_setup(runner._Report(), None, b"Traceback ...")


FILL_DISK = """import os
written = 0
for i in range(8):
    with open(f'f{i}', 'wb') as handle:
        handle.write(b'x' * 1_000_000)
    written += 1
print(written)
"""


def test_working_directory_has_a_size_quota(namespaces, sandbox_root):
    """Attack 3 (disk): each file stays under file_size_mb, together they exceed disk_mb."""
    limits = SandboxLimits(file_size_mb=1, disk_mb=3, **FAST)
    result = run_python(FILL_DISK, limits=limits)
    assert result.status == "error" and "No space left on device" in result.stderr, result
    assert run_python(FILL_DISK, limits=SandboxLimits(file_size_mb=1, disk_mb=16, **FAST)).stdout == "8\n"
    assert list(sandbox_root.iterdir()) == []


MEMORY_TOGETHER = """import os, sys, time
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (100 << 20)
        time.sleep(1.0)
        os._exit(0)
    children.append(pid)
block = b'x' * (100 << 20)
failed = [os.waitpid(pid, 0)[1] for pid in children]
print('statuses', failed)
sys.exit(1 if any(failed) else 0)
"""


def test_whole_sandbox_memory_is_capped(namespaces, sandbox_root):
    """Attack 3 (memory): four processes of 100 MiB each, every one under memory_mb=160, 400 MiB together;
    the cgroup caps the sandbox at memory_mb + disk_mb = 168 MiB."""
    limits = SandboxLimits(cpu_time_s=4.0, wall_time_s=8.0, memory_mb=160, disk_mb=8, max_processes=8)
    probe = run_python("", limits=limits)
    if "cgroup_memory" not in probe.isolation:
        pytest.skip("SKIPPED: no writable memory cgroup here; the whole-sandbox cap is then only the documented "
                    f"bound memory_mb x max_processes + disk_mb + file_size_mb = {limits.memory_bound_mb} MiB")
    result = run_python(MEMORY_TOGETHER, limits=limits)
    assert result.status == "memory", result
    assert processes_in(sandbox_root) == [] and list(sandbox_root.iterdir()) == []
    alone = run_python(MEMORY_TOGETHER.replace("range(3)", "range(0)"), limits=limits)
    assert alone.ok, alone  # one such process alone fits: the cap is on the sandbox, not per process


def test_documented_memory_bound_without_a_cgroup():
    limits = SandboxLimits(memory_mb=100, max_processes=4, disk_mb=10, file_size_mb=2)
    assert limits.memory_bound_mb == 100 * 4 + 10 + 2
