"""Starting, watching and stopping sandboxed programs from the trainer: `run_python`, `run_python_async`.

Per run the trainer waits for one of the process-wide slots (`set_max_concurrent_runs`; every caller in the
process shares them, so 256 concurrent tool calls start at most that many sandboxes and queue the rest), makes
a private directory (`tempfile.mkdtemp`, deleted afterwards) holding the job file and, without namespaces,
the working directory, and a memory cgroup where the kernel allows (`_cgroup.py`). It starts `_child.py`
with the base interpreter (`python -I -S -B -X utf8`: no site-packages, no PYTHON* variables, no bytecode
writes) in a new session, with a minimal environment (PATH, HOME and TMPDIR = the working directory, LANG)
and nothing else inherited: no secrets, no fds but the report pipe. The trainer itself never compiles or
runs the program.

Trust: what the program writes (stdout, stderr, its exit status) is the program's result and nothing more.
The sandbox's own processes talk to the trainer on the report pipe, which the program never holds; a setup
error counts only when it arrives there before the 'started' line, which the supervisor writes before the
program may run. A setup failure raises `SandboxError`; nothing is ever run again with weaker isolation, and
no run changes how later runs are isolated.

Watching: stdout and stderr are read as they come, each kept up to `output_bytes` (so a program printing
gigabytes costs the trainer 2 x `output_bytes` of memory); past that, or past `wall_time_s`, the whole
process group is killed with SIGKILL (and with it pid 1 of the sandbox's pid namespace, which takes every
process in the namespace down). The trainer's own pid is never visible to the program. Whatever happens in
the caller (an exception, a SIGALRM from the reward pool's timeout, an asyncio cancellation), the `finally`
blocks kill the group and delete the directory and the cgroup.

Cost per run of a trivial program (2 cores shared with other jobs, load ~3.5): about 80-120 ms with
namespaces, 50-70 ms without; two interpreter start-ups dominate, the namespace setup takes ~10 ms.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridflow.sandbox import _slots
from hybridflow.sandbox._cgroup import Cgroup, create_cgroup
from hybridflow.sandbox._runtime import BLOCKED_EXIT, BLOCKED_MARK
from hybridflow.sandbox.limits import HarnessVerdict, SandboxError, SandboxLimits, SandboxResult, SandboxStatus

__all__ = ["max_concurrent_runs", "run_python", "run_python_async", "set_max_concurrent_runs"]

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_child.py")
_SANDBOX_UID = 65534  # `nobody`: the uid a root trainer's sandboxes run as (inside their user namespace)
_CHUNK = 65536
_STOP_GRACE_S = 5.0  # how long to wait for killed processes to be reaped
_CHILD_REAP_S = 0.5  # how long the group leader gets to reap its killed children before the group is killed
_NAMESPACES_HELP = (
    "SandboxLimits.isolation='namespaces' (the default) requires Linux user namespaces. Enable them "
    "(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; in Docker, a seccomp/AppArmor "
    "profile that allows unshare), or accept running untrusted code with rlimits and an audit hook only by "
    "setting isolation='none' (code rewards: reward_model.scoring.sandbox.isolation=none; code interpreter "
    "tool: config.limits.isolation: none)")


def set_max_concurrent_runs(num_runs: int) -> None:
    """Let at most `num_runs` sandboxes of this process run at once (all callers, sync and async, share the
    limit; the rest wait in order). Default: the CPU cores this process may use, at least 4."""
    _slots.SLOTS.resize(num_runs)


def max_concurrent_runs() -> int:
    """How many sandboxes this process runs at once (`set_max_concurrent_runs`)."""
    return _slots.SLOTS.size


@dataclass
class _Launch:
    base_dir: str
    work_dir: str
    argv: list[str]
    env: dict[str, str]
    report_r: int
    report_w: int
    cgroup: Cgroup | None


@dataclass
class _Report:
    """What the sandbox's own processes reported (never the program: it does not hold the pipe)."""

    started: bool = False
    setup_error: str | None = None
    namespaces_unavailable: bool = False
    facts: dict = field(default_factory=dict)
    tests: HarnessVerdict | None = None


def _check_args(code: str, stdin: str, limits: SandboxLimits | None, files: Mapping[str, str | bytes] | None,
                tests: str | None, test_setup: str | None = None,
                program_names: Collection[str] | None = None) -> SandboxLimits:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if tests is not None and not isinstance(tests, str):
        raise TypeError(f"tests must be a str or None, got {type(tests).__name__}")
    if tests is None and (test_setup is not None or program_names is not None):
        raise ValueError("test_setup and program_names need tests")
    if test_setup is not None and not isinstance(test_setup, str):
        raise TypeError(f"test_setup must be a str or None, got {type(test_setup).__name__}")
    if program_names is not None and (isinstance(program_names, str)
                                      or not all(isinstance(n, str) and n.isidentifier() for n in program_names)):
        raise TypeError(f"program_names must be a collection of identifiers, got {program_names!r}")
    if limits is not None and not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    for name, content in (files or {}).items():
        parts = Path(name).parts if isinstance(name, str) else ()
        if not parts or Path(name).is_absolute() or ".." in parts or "\0" in name:
            raise ValueError(f"files: {name!r} must be a relative path inside the working directory")
        if not isinstance(content, (str, bytes)):
            raise TypeError(f"files[{name!r}] must be str or bytes, got {type(content).__name__}")
    return limits or SandboxLimits()


def _prepare(code: str, limits: SandboxLimits, files: Mapping[str, str | bytes] | None,
             tests: str | None, test_setup: str | None = None,
             program_names: Collection[str] | None = None) -> _Launch:
    python = os.path.realpath(sys.executable) if sys.executable else ""
    if not os.path.isfile(python):
        raise SandboxError(f"no Python interpreter to start (sys.executable={sys.executable!r})")
    base = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    cgroup = None
    try:
        work = os.path.join(base, "work")
        os.mkdir(work, 0o700)
        # the harness (runs with tests) takes a task of its own, as in _child's RLIMIT_NPROC
        cgroup = create_cgroup((limits.memory_mb + limits.disk_mb) << 20, limits.max_processes + (tests is not None))
        encoded = {name: base64.b64encode(content.encode() if isinstance(content, str) else content).decode()
                   for name, content in (files or {}).items()}
        job = {"code": code, "tests": tests, "test_setup": test_setup,
               "program_names": None if program_names is None else sorted(program_names), "files": encoded,
               "base_dir": base, "work_dir": work,
               "limits": asdict(limits), "isolation": limits.isolation, "sandbox_uid": _SANDBOX_UID,
               "cgroup": cgroup.path if cgroup else None}
        job_path = os.path.join(base, "job.json")
        with open(os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as handle:
            json.dump(job, handle)
        report_r, report_w = os.pipe()
    except BaseException:
        if cgroup is not None:
            cgroup.remove()
        _remove_tree(base)
        raise
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8"}
    argv = [python, "-I", "-S", "-B", "-X", "utf8", str(_CHILD), job_path, str(report_w)]
    return _Launch(base, work, argv, env, report_r, report_w, cgroup)


def _remove_tree(path: str) -> None:
    def retry_writable(function, target, _exc_info) -> None:
        try:  # the program may have removed permissions from what it created
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
            function(target)
        except OSError as err:
            logger.warning("sandbox: could not delete %s: %s", target, err)

    shutil.rmtree(path, onerror=retry_writable)


def _kill_group(pid: int, returncode: int | None) -> None:
    """SIGKILL the sandbox's process group, unless its leader was already reaped (its id may be reused).

    The leader's children die first and the leader reaps them: killed together, a child (the namespaces' init)
    outlives its parent as a zombie handed to the nearest subreaper, which is the trainer itself where it runs as
    a container's pid 1 without an init, and nothing there reaps it (one zombie per stopped run)."""
    if returncode is not None:
        return
    children = _children_of(pid)
    for child in children:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _CHILD_REAP_S
    while children and time.monotonic() < deadline and any(os.path.exists(f"/proc/{child}") for child in children):
        time.sleep(0.002)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _children_of(pid: int) -> list[int]:
    """The live children of `pid` (Linux's /proc; empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
            return [int(child) for child in handle.read().split()]
    except (OSError, ValueError):
        return []


def _read_report(fd: int) -> _Report:
    """Parse the report pipe in order; a setup error after 'started' is ignored (it cannot be one)."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    report = _Report()
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            fields = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(fields, dict):
            continue
        if "setup_error" in fields:
            if not report.started and report.setup_error is None:
                report.setup_error = str(fields["setup_error"])
                report.namespaces_unavailable = bool(fields.get("namespaces_unavailable"))
        elif fields.get("started") is True:
            report.started = True
        elif isinstance(fields.get("tests"), dict):
            verdict = fields["tests"]
            report.tests = HarnessVerdict(passed=verdict.get("passed") is True, started=verdict.get("started") is True,
                                       detail=str(verdict.get("detail", "")))
        else:
            report.facts.update(fields)
    return report


def _check_setup(report: _Report, stopped: str | None, stderr: bytes) -> None:
    """Raise `SandboxError` when the sandbox failed before the program started."""
    if report.namespaces_unavailable:
        raise SandboxError(f"Linux namespaces are unavailable on this machine ({report.setup_error}). "
                           f"{_NAMESPACES_HELP}")
    if report.setup_error is not None:
        raise SandboxError(f"sandbox setup failed: {report.setup_error}")
    if not report.started and stopped is None:
        tail = stderr.decode("utf-8", "replace")[-1000:]  # no program ran: only the sandbox's own output
        raise SandboxError(f"sandbox setup ended without a report; its stderr: {tail or '(empty)'}")


def _classify(stopped: str | None, facts: dict, stderr: str, limits: SandboxLimits,
              oom_kills: int) -> tuple[SandboxStatus, int | None]:
    if stopped is not None:
        return ("memory" if oom_kills else stopped), None  # type: ignore[return-value]
    code, sig, cpu_s = facts.get("exit_code"), facts.get("signal"), facts.get("cpu_s") or 0.0
    tail = stderr[-2000:]
    if isinstance(sig, int):
        if oom_kills:
            return "memory", -sig
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_time_s):
            return "timeout", -sig
        return ("memory" if "MemoryError" in tail else "killed"), -sig
    if not isinstance(code, int):  # the sandbox's supervisor died (e.g. the OOM killer) before reporting
        return ("memory" if oom_kills else "killed"), None
    if code == BLOCKED_EXIT and BLOCKED_MARK in tail:
        return "blocked", code
    if code != 0:
        last = tail.rstrip().rsplit("\n", 1)[-1]
        return ("memory" if last.startswith("MemoryError") or oom_kills else "error"), code
    return "ok", 0


def _annotate_traceback(stderr: str, code: str, max_lines: int = 50) -> str:
    """Add the source line under each `File "<sandbox>", line N` of a traceback (the child has no file)."""
    lines = code.splitlines()
    out, added = [], 0
    for line in stderr.split("\n"):
        out.append(line)
        match = re.match(r'\s*File "<sandbox>", line (\d+), in ', line)  # SyntaxErrors show their line
        if match and added < max_lines and 0 < int(match.group(1)) <= len(lines):
            out.append("    " + lines[int(match.group(1)) - 1].strip()[:200])
            added += 1
    return "\n".join(out)


def _finish(launch: _Launch, code: str, limits: SandboxLimits, stdout: bytes, stderr: bytes,
            stopped: str | None, wall_s: float) -> SandboxResult:
    report = _read_report(launch.report_r)
    _check_setup(report, stopped, stderr)
    err_text = stderr.decode("utf-8", "replace")
    oom_kills = launch.cgroup.oom_kills() if launch.cgroup is not None else 0
    status, exit_code = _classify(stopped, report.facts, err_text, limits, oom_kills)
    isolation = tuple(str(layer) for layer in report.facts.get("layers", ()))
    if launch.cgroup is not None:
        isolation += (launch.cgroup.layer,)
    return SandboxResult(status=status, exit_code=exit_code, stdout=stdout.decode("utf-8", "replace"),
                         stderr=_annotate_traceback(err_text, code), wall_s=round(wall_s, 4),
                         cpu_s=report.facts.get("cpu_s") if stopped is None else None, isolation=isolation,
                         isolation_mode=limits.isolation, tests=report.tests)


def _pump(proc: subprocess.Popen, data: bytes, limits: SandboxLimits, deadline: float,
          out: bytearray, err: bytearray) -> str | None:
    """Feed stdin and collect stdout/stderr until both close; the reason the trainer must stop it, if any."""
    buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    stdin_fd, pending = proc.stdin.fileno(), memoryview(data)
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(selector.get_map()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in selector.select(remaining):
                if key.fd == stdin_fd:
                    try:
                        pending = pending[os.write(stdin_fd, pending[:_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the program stopped reading; the rest of stdin is dropped
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = limits.output_bytes - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    return "output_limit"
    return None


def _run_sync(code: str, stdin: str, limits: SandboxLimits, files, tests: str | None, test_setup: str | None,
              program_names: Collection[str] | None) -> SandboxResult:
    launch = _prepare(code, limits, files, tests, test_setup, program_names)
    proc = None
    try:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=launch.work_dir, env=launch.env, bufsize=0,
                                    start_new_session=True, close_fds=True, pass_fds=(launch.report_w,))
        except OSError as err:
            raise SandboxError(f"could not start the sandbox interpreter: {err}") from err
        os.close(launch.report_w)
        launch.report_w = -1
        out, err = bytearray(), bytearray()
        stopped = _pump(proc, stdin.encode(), limits, start + limits.wall_time_s, out, err)
        if stopped is None:
            try:
                proc.wait(timeout=max(0.0, start + limits.wall_time_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = "timeout"
        wall_s = time.monotonic() - start
        if stopped is not None:
            _stop_sync(proc)
        return _finish(launch, code, limits, bytes(out), bytes(err), stopped, wall_s)
    finally:
        if proc is not None:
            _stop_sync(proc)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        _clean_up(launch)


def _stop_sync(proc: subprocess.Popen) -> None:
    """Kill the sandbox's process group (if its leader is still unreaped) and reap the leader."""
    _kill_group(proc.pid, proc.poll())
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("sandbox: process %d did not exit %.0f s after SIGKILL", proc.pid, _STOP_GRACE_S)


def _clean_up(launch: _Launch) -> None:
    """After the sandbox's processes are killed and reaped: close the report pipe, remove the cgroup (killing
    anything that escaped the process group) and the directory."""
    for fd in (launch.report_r, launch.report_w):
        if fd >= 0:
            os.close(fd)
    launch.report_r = launch.report_w = -1
    if launch.cgroup is not None:
        launch.cgroup.remove()
    _remove_tree(launch.base_dir)


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
               files: Mapping[str, str | bytes] | None = None, tests: str | None = None,
               test_setup: str | None = None, program_names: Collection[str] | None = None) -> SandboxResult:
    """Run the Python program `code` in a fresh sandbox and return how it ended.

    Waits for a free slot first (`set_max_concurrent_runs`).

    Args:
        code: program source, run as `__main__` (standard library only: no site-packages).
        stdin: text fed to the program's stdin (UTF-8).
        limits: resource limits; default `SandboxLimits()`.
        files: relative path -> content (str as UTF-8, or bytes), written into the working directory first.
        tests: test code to run against the program once its module code has run, in a separate harness
            process the program cannot reach (see `_harness.py`): names the tests do not define (the entry
            point, helpers) are looked up in the program, calls and results cross as plain data. The verdict
            is `SandboxResult.tests`; nothing the program prints or does can forge it.
        test_setup: trusted code the harness runs before `tests`, in the same globals (the prompt's stub:
            its imports and helpers are then the referee's own, whatever the program defines).
        program_names: the only names the tests may take from the program (the entry point and the stub's
            functions the answer implements); they override the setup's definitions. None: any name that
            neither the setup nor the tests define.

    Returns:
        A `SandboxResult`; a program's failure (exception, timeout, forbidden action) is a status, not an
        exception here.

    Raises:
        SandboxError: the sandbox could not start (the program did not run), e.g. namespaces are unavailable
            while `limits.isolation='namespaces'`; the message names the setting to change.
        TypeError, ValueError: invalid arguments.
    """
    limits = _check_args(code, stdin, limits, files, tests, test_setup, program_names)
    with _slots.SLOTS.hold():
        return _run_sync(code, stdin, limits, files, tests, test_setup, program_names)


async def _drain(stream: asyncio.StreamReader, buffer: bytearray, cap: int, stop) -> None:
    while chunk := await stream.read(_CHUNK):
        room = cap - len(buffer)
        buffer += chunk[:max(room, 0)]
        if len(chunk) > room:
            stop("output_limit")  # keep reading (and dropping) until the killed processes close the pipe


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program stopped reading; the rest of stdin is dropped
    finally:
        writer.close()


async def _run_async(code: str, stdin: str, limits: SandboxLimits, files, tests: str | None,
                     test_setup: str | None, program_names: Collection[str] | None) -> SandboxResult:
    launch = _prepare(code, limits, files, tests, test_setup, program_names)
    proc = None
    try:
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=launch.work_dir, env=launch.env, start_new_session=True, close_fds=True,
                pass_fds=(launch.report_w,))
        except OSError as err:
            raise SandboxError(f"could not start the sandbox interpreter: {err}") from err
        os.close(launch.report_w)
        launch.report_w = -1
        out, err, stopped = bytearray(), bytearray(), []

        def stop(reason: str) -> None:
            if not stopped:
                stopped.append(reason)
                _kill_group(proc.pid, proc.returncode)

        tasks = [asyncio.create_task(_drain(proc.stdout, out, limits.output_bytes, stop)),
                 asyncio.create_task(_drain(proc.stderr, err, limits.output_bytes, stop)),
                 asyncio.create_task(_feed(proc.stdin, stdin.encode())), asyncio.create_task(proc.wait())]
        try:
            _, pending = await asyncio.wait(tasks, timeout=limits.wall_time_s)
            if pending:
                stop("timeout")
                await asyncio.wait(pending, timeout=_STOP_GRACE_S)
        finally:
            for task in tasks:
                task.cancel()
        wall_s = time.monotonic() - start
        return _finish(launch, code, limits, bytes(out), bytes(err), stopped[0] if stopped else None, wall_s)
    finally:
        if proc is not None:
            _kill_group(proc.pid, proc.returncode)
            await _reap(proc)
        await asyncio.to_thread(_clean_up, launch)  # removing the cgroup may wait for killed processes


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for the (killed) sandbox and drain its pipes, so that asyncio can close the transport, also
    when the run was cancelled half-way (instant when the run finished normally)."""
    proc.stdin.close()
    try:
        await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.stderr.read(), proc.wait()), _STOP_GRACE_S)
    except asyncio.TimeoutError:
        logger.warning("sandbox: process %d did not exit %.0f s after SIGKILL", proc.pid, _STOP_GRACE_S)


async def run_python_async(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
                           files: Mapping[str, str | bytes] | None = None, tests: str | None = None,
                           test_setup: str | None = None,
                           program_names: Collection[str] | None = None) -> SandboxResult:
    """`run_python` for asyncio callers (agent loops running many tools at once): the same sandbox and
    arguments, watched with `asyncio.create_subprocess_exec` so the event loop stays free; the wait for a
    slot does not block it either. Cancelling it (also while waiting) kills the sandbox and frees the slot."""
    limits = _check_args(code, stdin, limits, files, tests, test_setup, program_names)
    async with _slots.SLOTS.hold_async():
        return await _run_async(code, stdin, limits, files, tests, test_setup, program_names)
