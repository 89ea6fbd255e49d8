"""hybridflow.sandbox: adversarial programs (each must end with the expected status, leave no trace outside
its directory and no process behind, and leave this process, the 'trainer', unaffected) and normal use.

Every case runs twice: with namespaces (the default, required: a machine without unprivileged user namespaces
fails these cases unless HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1 says it cannot give them, then they skip) and with
isolation='none' (rlimits, the seccomp filter and the audit hook only)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import tempfile
import time
import uuid

import pytest

from hybridflow.sandbox import SandboxError, SandboxLimits, run_python, run_python_async
from tests.helpers import most_at_once
from tests.sandbox.namespaces import processes_in, require_namespaces

LIMITS = dict(cpu_time_s=1.0, wall_time_s=2.0, memory_mb=256, output_bytes=4096, max_processes=8, file_size_mb=1)
SECRET = f"secret-{uuid.uuid4().hex}"
TRAINER_PID = os.getpid()


@pytest.fixture(params=[True, False], ids=["namespaces", "hook_only"])
def use_namespaces(request) -> bool:
    if request.param:
        require_namespaces()
    return request.param


def limits_for(use_namespaces: bool, **fields) -> SandboxLimits:
    return SandboxLimits(isolation="namespaces" if use_namespaces else "none", **fields)


@pytest.fixture
def sandbox_root(tmp_path, monkeypatch):
    """Sandboxes make their directories here, so the test can check that nothing is left behind."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", SECRET)
    return root


@pytest.fixture
def outside():
    """A path outside every sandbox that programs try to create; removed afterwards whatever happened."""
    path = f"/tmp/hybridflow-outside-{uuid.uuid4().hex}"
    yield path
    if os.path.lexists(path):
        os.remove(path)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "trainer-file.txt"
    path.write_text("precious")
    return str(path)


def ctypes_library() -> str:
    import _ctypes

    return _ctypes.__file__


# id -> (program, expected statuses with namespaces, expected statuses hook-only). Placeholders: {outside},
# {outside_name}, {victim}, {trainer_pid}, {ctypes_so}.
ADVERSARIAL = {
    "infinite_loop": ("while True: pass", {"timeout"}, {"timeout"}),
    "sleep_forever": ("import time\ntime.sleep(1000)", {"timeout"}, {"timeout"}),
    "ignore_sigxcpu": ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass",
                       {"timeout"}, {"timeout"}),
    "memory_at_once": ("x = bytearray(1 << 30)", {"memory"}, {"memory"}),
    "memory_gradual": ("chunks = []\nwhile True: chunks.append(bytearray(10**6))", {"memory"}, {"memory"}),
    "stdout_flood": ("import sys\nwhile True: sys.stdout.write('x' * 65536)", {"output_limit"}, {"output_limit"}),
    "stderr_flood": ("import os\nwhile True: os.write(2, b'e' * 65536)", {"output_limit"}, {"output_limit"}),
    "fork_bomb": ("import os\nwhile True: os.fork()", {"error"}, {"blocked"}),
    "fork_bomb_retrying": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                           {"timeout"}, {"blocked"}),
    "thread_bomb": ("import threading, time\nwhile True:\n"
                    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", {"error"}, {"error"}),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('survived')", {"ok"}, {"blocked"}),
    "kill_everything": ("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')", {"error"}, {"blocked"}),
    "kill_trainer": ("import os, signal\nos.kill({trainer_pid}, signal.SIGKILL)", {"error"}, {"blocked"}),
    "kill_own_group": ("import os, signal\nos.killpg(0, signal.SIGKILL)", {"killed"}, {"blocked"}),
    "write_outside": ("open('{outside}', 'w').write('x')", {"blocked"}, {"blocked"}),
    "os_open_outside": ("import os\nos.open('{outside}', os.O_WRONLY | os.O_CREAT)", {"blocked"}, {"blocked"}),
    "symlink_escape": ("import os\nos.symlink('/tmp', 'escape')\nopen('escape/{outside_name}', 'w').write('x')",
                       {"blocked"}, {"blocked"}),
    "dir_fd_escape": ("import os\nfd = os.open('/tmp', os.O_RDONLY)\n"
                      "os.open('{outside_name}', os.O_WRONLY | os.O_CREAT, dir_fd=fd)", {"blocked"}, {"blocked"}),
    "remove_trainer_file": ("import os\nos.remove('{victim}')", {"blocked"}, {"blocked"}),
    "rename_trainer_file": ("import os\nos.rename('{victim}', 'stolen.txt')", {"blocked"}, {"blocked"}),
    "chmod_system_file": ("import os\nos.chmod('/etc/passwd', 0o666)", {"blocked"}, {"blocked"}),
    "write_proc_sys": ("open('/proc/sys/kernel/hostname', 'w').write('pwned')", {"blocked"}, {"blocked"}),
    "sqlite_outside": ("import sqlite3\nsqlite3.connect('{outside}')", {"blocked"}, {"blocked"}),
    "monkeypatched_paths": ("import os, posixpath\nos.getcwd = lambda: '/tmp'\nposixpath.realpath = lambda p, **k: p\n"
                            "open('{outside}', 'w').write('x')", {"blocked"}, {"blocked"}),
    "trainer_environ": ("print(open('/proc/{trainer_pid}/environ').read())", {"blocked"}, {"blocked"}),
    "scan_all_environ": ("import os\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
                         "        print(open(f'/proc/{{pid}}/environ').read())", {"blocked", "ok"}, {"blocked"}),
    "tcp_connect": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", {"blocked"}, {"blocked"}),
    "udp_send": ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))",
                 {"blocked"}, {"blocked"}),
    "dns_lookup": ("import socket\nsocket.getaddrinfo('example.com', 80)", {"blocked"}, {"blocked"}),
    "unix_socket_to_host": ("import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('/run/docker.sock')",
                            {"blocked"}, {"blocked"}),
    "subprocess_run": ("import subprocess\nsubprocess.run(['touch', '{outside}'])", {"blocked"}, {"blocked"}),
    "os_system": ("import os\nos.system('touch {outside}')", {"blocked"}, {"blocked"}),
    "execv": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {outside}'])", {"blocked"}, {"blocked"}),
    "raw_fork_exec": ("import _posixsubprocess\n_posixsubprocess.fork_exec()", {"blocked"}, {"blocked"}),
    "reimport_fork_exec": ("import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
                           {"blocked"}, {"blocked"}),
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'touch {outside}')", {"blocked"}, {"blocked"}),
    "ctypes_renamed": ("import importlib.util\n"
                       "spec = importlib.util.spec_from_file_location('x._ctypes', '{ctypes_so}')\n"
                       "importlib.util.module_from_spec(spec)", {"blocked"}, {"blocked"}),
    "gc_objects": ("import gc\ngc.get_objects()", {"blocked"}, {"blocked"}),
    "settrace": ("import sys\nsys.settrace(lambda *args: None)", {"blocked"}, {"blocked"}),
    "subinterpreter": ("import _xxsubinterpreters", {"blocked"}, {"blocked"}),
    "deep_recursion_segfault": ("import json, sys\nsys.setrecursionlimit(10**6)\n"
                                "json.loads('[' * 10**6 + ']' * 10**6)", {"killed"}, {"killed"}),
    "close_stdout": ("import os\nos.close(1)\nprint('lost')", {"error"}, {"error"}),
    "daemonized_grandchild": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                              "        time.sleep(60)\n    os._exit(0)\nprint('parent done')", {"ok"}, {"blocked"}),
    "giant_file": ("f = open('big', 'wb')\nfor _ in range(64):\n    f.write(b'x' * 2**20)", {"error"}, {"error"}),
    "dev_shm_fill": ("f = open('/dev/shm/big', 'wb')\nf.write(b'x' * 2**20)", {"blocked"}, {"blocked"}),
    # no audit event for these: the seccomp filter refuses them (hook-only, they made files anywhere and killed
    # the trainer's processes past the hook's os.kill check)
    "mkfifo_outside": ("import os\nos.mkfifo('{outside}')", {"error"}, {"error"}),
    "mknod_outside": ("import os, stat\nos.mknod('{outside}', stat.S_IFREG | 0o644)", {"error"}, {"error"}),
    "pidfd_kill_trainer": ("import os, signal\nos.pidfd_send_signal(os.pidfd_open({trainer_pid}), signal.SIGKILL)",
                           {"error"}, {"error"}),
}


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_adversarial_program_is_contained(case, use_namespaces, sandbox_root, outside, victim):
    code, with_ns, hook_only = ADVERSARIAL[case]
    expected = with_ns if use_namespaces else hook_only
    code = code.format(outside=outside, outside_name=os.path.basename(outside), victim=victim,
                       trainer_pid=TRAINER_PID, ctypes_so=ctypes_library())
    cwd, passwd_mode = os.getcwd(), os.stat("/etc/passwd").st_mode
    result = run_python(code, limits=limits_for(use_namespaces, **LIMITS))
    assert result.status in expected, result
    assert result.wall_s < LIMITS["wall_time_s"] + 1.5
    if result.status == "blocked":
        assert "hybridflow-sandbox: blocked" in result.stderr
    if result.status == "output_limit":
        assert max(len(result.stdout), len(result.stderr)) == LIMITS["output_bytes"]
    # nothing escaped, nothing is left, the trainer is untouched
    assert not os.path.lexists(outside)
    assert open(victim).read() == "precious"
    assert os.stat("/etc/passwd").st_mode == passwd_mode
    assert SECRET not in result.stdout + result.stderr
    assert processes_in(sandbox_root) == []
    assert list(sandbox_root.iterdir()) == []
    assert (os.getpid(), os.getcwd(), os.environ["HYBRIDFLOW_TEST_SECRET"]) == (TRAINER_PID, cwd, SECRET)


def test_specific_outcomes(sandbox_root, use_namespaces):
    limits = limits_for(use_namespaces, **LIMITS)
    segfault = run_python(ADVERSARIAL["deep_recursion_segfault"][0], limits=limits)
    assert segfault.exit_code == -signal.SIGSEGV
    memory = run_python(ADVERSARIAL["memory_at_once"][0], limits=limits)
    assert memory.stderr.rstrip().endswith("MemoryError")
    assert "File too large" in run_python(ADVERSARIAL["giant_file"][0], limits=limits).stderr
    assert run_python("import os\nos.close(1)\nprint('lost')", limits=limits).exit_code == 120
    environ = run_python("import os\nprint(sorted(os.environ))", limits=limits)
    assert environ.stdout.strip() == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"
    assert run_python("print(open('/etc/passwd').read()[:4])", limits=limits).stdout == "root\n"
    assert run_python("open('/dev/null', 'w').write('x')", limits=limits).ok


def test_namespace_isolation_layers(sandbox_root):
    require_namespaces()
    code = ("import os\nprint(os.getppid(), sorted(os.listdir('/proc/self/task')) == [str(os.getpid())])\n"
            "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))\n"
            "print(sorted(os.listdir('/')))\nprint(os.getuid())\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
    result = run_python(code, limits=SandboxLimits(**LIMITS))
    assert result.ok, result
    ppid, interfaces, top, uid, pids = result.stdout.splitlines()
    assert ppid.split()[0] == "1"  # the sandbox's own init, never the trainer
    assert interfaces == "['lo']"
    assert "home" not in top and "run" not in top and "var" not in top
    assert int(uid) == (65534 if os.geteuid() == 0 else os.geteuid())
    assert len(eval(pids)) == 2  # R and the program: nothing of the host is visible
    assert {"user_ns", "net_ns", "pid_ns", "mount_ns", "readonly_root", "audit_hook"} <= set(result.isolation)


def test_stdin_stdout_round_trip(use_namespaces, sandbox_root):
    text = "héllo\n" + "x" * 200_000
    limits = limits_for(use_namespaces, output_bytes=300_000)
    result = run_python("import sys\nsys.stdout.write(sys.stdin.read()[::-1])", stdin=text, limits=limits)
    assert result.ok and result.exit_code == 0
    assert result.stdout == text[::-1]
    ignored = run_python("print('done')", stdin="y" * 1_000_000, limits=limits)  # never reads its stdin
    assert ignored.ok and ignored.stdout == "done\n"


def test_exception_reports_traceback(use_namespaces, sandbox_root):
    limits = limits_for(use_namespaces, **LIMITS)
    result = run_python("x = 1\ny = x / 0\n", limits=limits)
    assert (result.status, result.exit_code) == ("error", 1)
    assert 'File "<sandbox>", line 2, in <module>\n    y = x / 0\nZeroDivisionError' in result.stderr
    assert "_child" not in result.stderr and "runtime" not in result.stderr
    syntax = run_python("def broken(:\n", limits=limits)
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr
    assert run_python("import sys\nsys.exit(3)", limits=limits).exit_code == 3
    assert run_python("import sys\nsys.exit(0)", limits=limits).ok


def test_files_and_working_directory(use_namespaces, sandbox_root):
    code = ("import os, tempfile\nprint(open('data/in.txt').read(), open('raw.bin', 'rb').read())\n"
            "os.mkdir('made')\nopen('made/out.txt', 'w').write('ok')\nos.rename('made/out.txt', 'moved.txt')\n"
            "with tempfile.NamedTemporaryFile() as handle:\n    handle.write(b'tmp')\nprint(os.getcwd())")
    result = run_python(code, files={"data/in.txt": "hello", "raw.bin": b"\x00\x01"},
                        limits=limits_for(use_namespaces, **LIMITS))
    assert result.ok, result
    first, workdir = result.stdout.splitlines()
    assert first == "hello b'\\x00\\x01'"
    assert workdir.startswith(str(sandbox_root))
    assert not os.path.exists(workdir) and list(sandbox_root.iterdir()) == []


def test_standard_library_works(use_namespaces, sandbox_root):
    code = ("import asyncio, hashlib, json\nasync def f():\n    await asyncio.sleep(0)\n    return 2\n"
            "print(asyncio.run(f()), hashlib.sha256(b'').hexdigest()[:8], json.dumps([1]))")
    result = run_python(code, limits=limits_for(use_namespaces, **LIMITS))
    assert result.ok and result.stdout == "2 e3b0c442 [1]\n", result
    pool = run_python("import multiprocessing as mp\nwith mp.Pool(2) as p:\n    print(p.map(abs, [-1, -2]))",
                      limits=limits_for(use_namespaces, **LIMITS))
    assert pool.stdout == "[1, 2]\n" if use_namespaces else pool.status == "blocked"


def test_invalid_arguments():
    for field, value in [("cpu_time_s", 0), ("wall_time_s", -1), ("memory_mb", 8), ("output_bytes", 0),
                         ("max_processes", 0), ("file_size_mb", 0), ("disk_mb", 0),
                         ("isolation", "hook_only")]:
        with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
            SandboxLimits(**{field: value})
    for name in ("../escape.txt", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="files"):
            run_python("", files={name: "x"})
    with pytest.raises(TypeError):
        run_python(b"print(1)")


def test_missing_interpreter_raises(monkeypatch):
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    with pytest.raises(SandboxError):
        run_python("print(1)")


def test_interrupted_run_cleans_up(sandbox_root):
    """The reward pool stops a scorer with SIGALRM: the sandbox must still be killed and deleted."""
    class Interrupted(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            run_python("import time\ntime.sleep(30)", limits=SandboxLimits(wall_time_s=20))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert processes_in(sandbox_root) == [] and list(sandbox_root.iterdir()) == []


def test_async_runs_concurrently(sandbox_root):
    # Each program prints when it slept (CLOCK_MONOTONIC is one clock for every process of the machine).
    code = "import time\nstart = time.monotonic()\ntime.sleep(0.5)\nprint(start, time.monotonic())"

    async def main():
        return await asyncio.gather(*[run_python_async(code, limits=SandboxLimits(**LIMITS)) for _ in range(8)])

    results = asyncio.run(main())
    assert all(r.ok for r in results), results
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    # Awaited one after another, no two programs would sleep at the same time.
    assert most_at_once(intervals) >= 2, f"the sandboxes ran one after another: {intervals}"
    assert list(sandbox_root.iterdir()) == []


def test_async_limits_and_cancellation(sandbox_root):
    limits = SandboxLimits(**LIMITS)

    async def main():
        flood = await run_python_async(ADVERSARIAL["stdout_flood"][0], limits=limits)
        slow = await run_python_async("import time\ntime.sleep(100)", limits=limits)
        echo = await run_python_async("print(input()[::-1])", stdin="abc", limits=limits)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_python_async("import time\ntime.sleep(100)",
                                                    limits=SandboxLimits(wall_time_s=60)), timeout=0.5)
        return flood, slow, echo

    flood, slow, echo = asyncio.run(main())
    assert flood.status == "output_limit" and len(flood.stdout) == LIMITS["output_bytes"]
    assert slow.status == "timeout" and slow.wall_s < LIMITS["wall_time_s"] + 1.0
    assert echo.ok and echo.stdout == "cba\n"
    assert processes_in(sandbox_root) == [] and list(sandbox_root.iterdir()) == []
    assert stat.S_ISDIR(os.stat(sandbox_root).st_mode)


ZOMBIE_PROBE = """
import asyncio, ctypes, os, sys
from hybridflow.sandbox import SandboxLimits, run_python, run_python_async
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: this process stands for a container's pid 1
limits = SandboxLimits(isolation=sys.argv[1], wall_time_s=1.0, cpu_time_s=1.0, output_bytes=4096)
statuses = [run_python("import time\\ntime.sleep(60)", limits=limits).status,
            run_python("while True: print('x' * 9999)", limits=limits).status,
            asyncio.run(run_python_async("import time\\ntime.sleep(60)", limits=limits)).status]
zombies = []
for entry in os.listdir("/proc"):
    try:
        state, ppid = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        continue
    if state == "Z" and int(ppid) == os.getpid():
        zombies.append(entry)
print(statuses, zombies)
"""


def test_stopped_runs_leave_no_zombie_to_a_subreaper(use_namespaces, sandbox_root):
    """A run stopped by its wall time or its output limit kills the sandbox's processes so that their own parents
    reap them: none is orphaned to the trainer, which reaps nothing it did not start when it is a container's
    pid 1 (a subreaper here). Before, each stopped run left one zombie there."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    isolation = "namespaces" if use_namespaces else "none"
    result = subprocess.run([sys.executable, "-c", ZOMBIE_PROBE, isolation], capture_output=True, text=True,
                            timeout=120, cwd=REPO_ROOT, env={**os.environ, "TMPDIR": str(sandbox_root)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['timeout', 'output_limit', 'timeout'] []", result.stdout


def test_missing_namespaces_fail_the_suite_unless_declared(monkeypatch):
    """A machine without user namespaces must not leave the default isolation untested in silence."""
    monkeypatch.setattr("tests.sandbox.namespaces._NAMESPACES", [False])
    monkeypatch.delenv("HYBRIDFLOW_SANDBOX_NO_NAMESPACES", raising=False)
    with pytest.raises(pytest.fail.Exception, match="HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1"):
        require_namespaces()
    monkeypatch.setenv("HYBRIDFLOW_SANDBOX_NO_NAMESPACES", "1")
    with pytest.raises(pytest.skip.Exception, match="SKIPPED"):
        require_namespaces()
