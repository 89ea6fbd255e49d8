"""hybridflow.sandbox: a program cannot turn its isolation off, isolation is required by default, and the disk
and memory caps hold. Each attack is a test that fails on a sandbox that falls back, re-runs or trusts the
program's output (see docs/reliability.md)."""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybridflow.sandbox import SandboxError, SandboxLimits, run_python
from hybridflow.sandbox import runner
from tests.sandbox.namespaces import namespaces_work, processes_in, require_namespaces

FAST = dict(cpu_time_s=2.0, wall_time_s=4.0, memory_mb=256, max_processes=8)
NAMESPACE_LAYERS = {"user_ns", "net_ns", "pid_ns", "mount_ns", "readonly_root", "workdir_tmpfs"}


@pytest.fixture
def namespaces():
    require_namespaces()


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


# Holds as much memory as it can at once, in every way the standard library offers without a hook bypass:
# its heap (RLIMIT_AS), files in the working directory (a tmpfs of disk_mb), memfd files (not in RLIMIT_AS:
# refused by the seccomp filter). Prints MiB held per kind.
GRAB_MEMORY = """import errno, json, os, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE a write then fails with EFBIG
MiB = 1 << 20
chunk = b'x' * MiB
blocks = []
try:
    while True:
        blocks.append(bytearray(chunk))
except MemoryError:
    del blocks[-4:]  # room for the rest of the program
held = {'heap': len(blocks) * MiB}
names = iter(range(1 << 20))
def fill(make):
    total = 0
    while True:
        try:
            fd = make()
        except OSError:
            return total
        while True:
            try:
                total += os.write(fd, chunk)
            except OSError as err:
                if err.errno == errno.EFBIG:
                    break
                return total
held['workdir'] = fill(lambda: os.open(f'f{next(names)}', os.O_WRONLY | os.O_CREAT, 0o600))
held['memfd'] = fill(lambda: os.memfd_create('m'))
try:
    os.memfd_create('m')
except OSError as err:
    held['memfd_error'] = err.strerror
print(json.dumps(held))
"""


def test_memory_bound_without_a_cgroup_holds_for_a_real_program(namespaces, sandbox_root, monkeypatch):
    """The bound `memory_bound_mb` (no memory cgroup) against a program holding all it can: heap up to
    RLIMIT_AS, the working directory's tmpfs full, and memfd files, which RLIMIT_AS does not count (about 250
    x file_size_mb per process before the seccomp filter refused memfd_create)."""
    monkeypatch.setattr(runner, "create_cgroup", lambda *args: None)
    limits = SandboxLimits(cpu_time_s=10.0, wall_time_s=20.0, memory_mb=128, max_processes=1, disk_mb=8,
                           file_size_mb=2)
    result = run_python(GRAB_MEMORY, limits=limits)
    assert result.ok and "cgroup_memory" not in result.isolation, result
    held = json.loads(result.stdout)
    total_mb = (held["heap"] + held["workdir"] + held["memfd"]) / (1 << 20)
    assert held["memfd"] == 0 and held["memfd_error"] == "Operation not permitted", held
    assert held["workdir"] == limits.disk_mb << 20, held  # the program really filled what it may
    assert limits.memory_mb / 2 < total_mb <= limits.memory_bound_mb, (total_mb, held)


def test_kernel_refuses_memfd_nested_user_namespaces_and_shows_no_host_cgroup(namespaces, sandbox_root):
    program = ("import os\ntry:\n    os.memfd_create('m')\nexcept OSError as err:\n    print(err.strerror)\n"
               "print(open('/proc/sys/user/max_user_namespaces').read().strip())\n"
               "print(sorted({line.rsplit(':', 1)[1].strip() for line in open('/proc/self/cgroup')}))\n"
               "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n")
    result = run_python(program, limits=SandboxLimits(**FAST))
    assert result.stdout.split("\n")[:4] == ["Operation not permitted", "0", "['/']", "2"], result
    assert {"seccomp", "no_nested_userns", "cgroup_ns"} <= set(result.isolation), result.isolation
    unconfined = run_python("print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])",
                            limits=SandboxLimits(isolation="none", **FAST))
    assert unconfined.stdout == "2\n" and "seccomp" in unconfined.isolation  # the filter holds without namespaces


FORK_ALL = """import os, time
count = 1
try:
    while True:
        if os.fork() == 0:
            time.sleep(4)
            os._exit(0)
        count += 1
except OSError:
    print(count)
"""


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "rlimit_only"])
@pytest.mark.parametrize("tests", [None, "pass"], ids=["no_tests", "with_tests"])
def test_the_program_gets_exactly_max_processes(namespaces, sandbox_root, monkeypatch, cgroup, tests):
    """RLIMIT_NPROC and the pids cgroup both count the sandbox's own processes (P0, R, and H with tests):
    the program gets max_processes, itself included, whichever binds (they differed by one)."""
    if not cgroup:
        monkeypatch.setattr(runner, "create_cgroup", lambda *args: None)
    result = run_python(FORK_ALL, tests=tests, limits=SandboxLimits(cpu_time_s=2.0, wall_time_s=8.0,
                                                                    memory_mb=256, max_processes=4))
    assert result.stdout == "4\n", result


def test_seccomp_filter_refuses_namespaces_and_memfd_but_not_threads_or_fork():
    """The filter itself, in a forked copy of this process: unshare, clone with CLONE_NEWUSER, memfd_create,
    mkfifo/mknod and the pidfd calls fail with EPERM (a program could reach them with a hook bypass; mknod and
    pidfd_send_signal needed none: with isolation='none' they made files anywhere and killed the trainer's other
    processes), threads (clone3 -> clone) and fork work."""
    spec = importlib.util.spec_from_file_location("sandbox_child", Path(runner.__file__).with_name("_child.py"))
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    machine = os.uname().machine
    if machine not in child._SECCOMP:
        pytest.skip(f"SKIPPED: no seccomp filter for {machine}")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (runs in the fork)
        try:
            libc = child._Libc()
            libc("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            libc.install_seccomp(machine)
            lib = ctypes.CDLL(None, use_errno=True)
            clone = child._SECCOMP[machine][1]  # raw clone(CLONE_NEWUSER | SIGCHLD), as a program could call it
            fifo = f"/tmp/hybridflow-seccomp-fifo-{os.getpid()}".encode()
            calls = (lambda: lib.unshare(0x10000000), lambda: lib.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0),
                     lambda: lib.memfd_create(b"m", 0), lambda: lib.unshare(0),
                     lambda: lib.mkfifo(fifo, 0o600), lambda: lib.mknod(fifo, 0o100600, 0),
                     lambda: lib.syscall(434, os.getppid(), 0),  # pidfd_open
                     lambda: lib.syscall(424, 0, 15, 0, 0),  # pidfd_send_signal
                     lambda: lib.syscall(438, 0, 0, 0))  # pidfd_getfd
            refused = [(call(), ctypes.get_errno()) for call in calls]
            thread = threading.Thread(target=lambda: None)
            thread.start()
            thread.join()
            if os.fork() == 0:
                os._exit(0)
            os.wait()
            os.write(write_end, json.dumps(refused).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        refused = answer.read()
    os.waitpid(pid, 0)
    assert json.loads(refused) == [[-1, errno.EPERM]] * 9, refused
