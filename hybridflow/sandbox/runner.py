"""Starting, watching and stopping sandboxed programs from the trainer: `run_python`, `run_python_async`.

Per run the trainer makes a private directory (`tempfile.mkdtemp`, deleted afterwards) holding the working
directory and a job file, then starts `_child.py` with the base interpreter (`python -I -S -B -X utf8`: no
site-packages, no PYTHON* variables, no bytecode writes) in a new session, with a minimal environment
(PATH, HOME and TMPDIR = the working directory, LANG) and nothing else inherited: no secrets, no fds but
the report pipe. The trainer itself never compiles or runs the program.

Watching: stdout and stderr are read as they come, each kept up to `output_bytes` (so a program printing
gigabytes costs the trainer 2 x `output_bytes` of memory); past that, or past `wall_time_s`, the whole
process group is killed with SIGKILL (and with it pid 1 of the sandbox's pid namespace, which takes every
process in the namespace down). The trainer's own pid is never visible to the program. Whatever happens in
the caller (an exception, a SIGALRM from the reward pool's timeout, an asyncio cancellation), the `finally`
blocks kill the group and delete the directory.

Isolation layers are described in `_child.py` (namespaces) and `_runtime.py` (audit hook). The first run
learns whether namespaces work here; if they do not, one warning is logged and later runs use rlimits and
the audit hook only (`SandboxResult.isolation` always says what was active).

Cost per run of a trivial program (2 cores shared with other jobs, load ~3.5): about 80-120 ms with
namespaces, 50-70 ms without; two interpreter start-ups dominate, the namespace setup takes ~10 ms.
"""

from __future__ import annotations

import asyncio
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
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridflow.sandbox._runtime import BLOCKED_EXIT, BLOCKED_MARK, SETUP_EXIT, SETUP_MARK
from hybridflow.sandbox.limits import SandboxError, SandboxLimits, SandboxResult, SandboxStatus

__all__ = ["run_python", "run_python_async"]

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_child.py")
_SANDBOX_UID = 65534  # `nobody`: the uid a root trainer's sandboxes run as (inside their user namespace)
_CHUNK = 65536
_STOP_GRACE_S = 5.0  # how long to wait for killed processes to be reaped


class _SetupFailed(Exception):
    """The child reported that isolation could not be set up (the program did not run)."""


class _NamespaceSupport:
    """Whether namespaces work on this machine: None until the first run says, then True or False."""

    lock = threading.Lock()
    available: bool | None = None

    @classmethod
    def record(cls, available: bool, reason: str = "") -> None:
        with cls.lock:
            if cls.available is None or (cls.available and not available):
                if not available:
                    logger.warning(
                        "sandbox: Linux namespaces are unavailable (%s); untrusted code runs with rlimits and an "
                        "audit hook only: no kernel-level network or filesystem isolation, and os.fork is refused",
                        reason)
                cls.available = available


@dataclass
class _Launch:
    base_dir: str
    work_dir: str
    argv: list[str]
    env: dict[str, str]
    report_r: int
    report_w: int


def _check_args(code: str, stdin: str, limits: SandboxLimits | None,
                files: Mapping[str, str | bytes] | None) -> SandboxLimits:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if limits is not None and not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    for name, content in (files or {}).items():
        parts = Path(name).parts if isinstance(name, str) else ()
        if not parts or Path(name).is_absolute() or ".." in parts or "\0" in name:
            raise ValueError(f"files: {name!r} must be a relative path inside the working directory")
        if not isinstance(content, (str, bytes)):
            raise TypeError(f"files[{name!r}] must be str or bytes, got {type(content).__name__}")
    return limits or SandboxLimits()


def _write_files(work_dir: str, files: Mapping[str, str | bytes], owner: int | None) -> None:
    for name, content in files.items():
        path = Path(work_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    if owner is not None:  # a root trainer's sandbox runs as `owner`: it must own its working directory
        for root, dirs, names in os.walk(work_dir):
            os.chown(root, owner, owner)
            for name in dirs + names:
                os.chown(os.path.join(root, name), owner, owner, follow_symlinks=False)


def _prepare(code: str, limits: SandboxLimits, files: Mapping[str, str | bytes] | None,
             use_namespaces: bool) -> _Launch:
    python = os.path.realpath(sys.executable) if sys.executable else ""
    if not os.path.isfile(python):
        raise SandboxError(f"no Python interpreter to start (sys.executable={sys.executable!r})")
    base = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    try:
        work = os.path.join(base, "work")
        os.mkdir(work, 0o700)
        owner = _SANDBOX_UID if use_namespaces and os.geteuid() == 0 else None
        _write_files(work, files or {}, owner)
        job = {"code": code, "base_dir": base, "work_dir": work, "limits": asdict(limits),
               "use_namespaces": use_namespaces, "sandbox_uid": _SANDBOX_UID}
        job_path = os.path.join(base, "job.json")
        with open(os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as handle:
            json.dump(job, handle)
        report_r, report_w = os.pipe()
    except BaseException:
        _remove_tree(base)
        raise
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8"}
    argv = [python, "-I", "-S", "-B", "-X", "utf8", str(_CHILD), job_path, str(report_w)]
    return _Launch(base, work, argv, env, report_r, report_w)


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
    """SIGKILL the sandbox's process group, unless its leader was already reaped (its id may be reused)."""
    if returncode is not None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _read_report(fd: int) -> dict:
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
    report: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            fields = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(fields, dict):
            report.update(fields)
    if "setup_error" in report:
        raise _SetupFailed(str(report["setup_error"]))
    return report


def _classify(stopped: str | None, report: dict, stderr: str,
              limits: SandboxLimits) -> tuple[SandboxStatus, int | None]:
    if stopped is not None:
        return stopped, None  # type: ignore[return-value]
    code, sig, cpu_s = report.get("exit_code"), report.get("signal"), report.get("cpu_s") or 0.0
    tail = stderr[-2000:]
    if isinstance(sig, int):
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_time_s):
            return "timeout", -sig
        return ("memory" if "MemoryError" in tail else "killed"), -sig
    if not isinstance(code, int):
        return "killed", None  # the sandbox's own processes were killed (e.g. by the program) before reporting
    if code == SETUP_EXIT and SETUP_MARK in tail:
        raise _SetupFailed(tail.rsplit(SETUP_MARK, 1)[-1].strip())
    if code == BLOCKED_EXIT and BLOCKED_MARK in tail:
        return "blocked", code
    if code != 0:
        last = tail.rstrip().rsplit("\n", 1)[-1]
        return ("memory" if last.startswith("MemoryError") else "error"), code
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
    err_text = stderr.decode("utf-8", "replace")
    status, exit_code = _classify(stopped, report, err_text, limits)
    isolation = tuple(str(layer) for layer in report.get("layers", ()))
    if report.get("namespace_error") and limits.use_namespaces:
        _NamespaceSupport.record(False, str(report["namespace_error"]))
    elif "user_ns" in isolation:
        _NamespaceSupport.record(True)
    return SandboxResult(status=status, exit_code=exit_code, stdout=stdout.decode("utf-8", "replace"),
                         stderr=_annotate_traceback(err_text, code), wall_s=round(wall_s, 4),
                         cpu_s=report.get("cpu_s") if stopped is None else None, isolation=isolation)


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


def _run_sync(code: str, stdin: str, limits: SandboxLimits, files, use_namespaces: bool) -> SandboxResult:
    launch = _prepare(code, limits, files, use_namespaces)
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
        _close_report(launch)
        _remove_tree(launch.base_dir)


def _stop_sync(proc: subprocess.Popen) -> None:
    """Kill the sandbox's process group (if its leader is still unreaped) and reap the leader."""
    _kill_group(proc.pid, proc.poll())
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("sandbox: process %d did not exit %.0f s after SIGKILL", proc.pid, _STOP_GRACE_S)


def _close_report(launch: _Launch) -> None:
    for fd in (launch.report_r, launch.report_w):
        if fd >= 0:
            os.close(fd)


def _namespaces_first(limits: SandboxLimits) -> bool:
    return limits.use_namespaces and _NamespaceSupport.available is not False


def _after_setup_failure(err: _SetupFailed, used_namespaces: bool) -> None:
    """A run whose namespace setup failed is repeated once without namespaces (and later runs skip them)."""
    if not used_namespaces:
        raise SandboxError(f"sandbox setup failed: {err}") from err
    _NamespaceSupport.record(False, str(err))


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
               files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
    """Run the Python program `code` in a fresh sandbox and return how it ended.

    Args:
        code: program source, run as `__main__` (standard library only: no site-packages).
        stdin: text fed to the program's stdin (UTF-8).
        limits: resource limits; default `SandboxLimits()`.
        files: relative path -> content (str as UTF-8, or bytes), written into the working directory first.

    Returns:
        A `SandboxResult`; a program's failure (exception, timeout, forbidden action) is a status, not an
        exception here.

    Raises:
        SandboxError: the sandbox could not start (the program did not run).
        TypeError, ValueError: invalid arguments.
    """
    limits = _check_args(code, stdin, limits, files)
    use_namespaces = _namespaces_first(limits)
    try:
        return _run_sync(code, stdin, limits, files, use_namespaces)
    except _SetupFailed as err:
        _after_setup_failure(err, use_namespaces)
    try:
        return _run_sync(code, stdin, limits, files, False)
    except _SetupFailed as err:
        raise SandboxError(f"sandbox setup failed: {err}") from err


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


async def _run_async(code: str, stdin: str, limits: SandboxLimits, files, use_namespaces: bool) -> SandboxResult:
    launch = _prepare(code, limits, files, use_namespaces)
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
        _close_report(launch)
        _remove_tree(launch.base_dir)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for the (killed) sandbox and drain its pipes, so that asyncio can close the transport, also
    when the run was cancelled half-way (instant when the run finished normally)."""
    proc.stdin.close()
    try:
        await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.stderr.read(), proc.wait()), _STOP_GRACE_S)
    except asyncio.TimeoutError:
        logger.warning("sandbox: process %d did not exit %.0f s after SIGKILL", proc.pid, _STOP_GRACE_S)


async def run_python_async(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
                           files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
    """`run_python` for asyncio callers (agent loops running many tools at once): the same sandbox, watched
    with `asyncio.create_subprocess_exec` so the event loop stays free. Cancelling it kills the sandbox."""
    limits = _check_args(code, stdin, limits, files)
    use_namespaces = _namespaces_first(limits)
    try:
        return await _run_async(code, stdin, limits, files, use_namespaces)
    except _SetupFailed as err:
        _after_setup_failure(err, use_namespaces)
    try:
        return await _run_async(code, stdin, limits, files, False)
    except _SetupFailed as err:
        raise SandboxError(f"sandbox setup failed: {err}") from err
