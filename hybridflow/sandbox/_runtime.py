"""What runs in the program's own interpreter: the audit hook (PEP 578), then the program as `__main__`.

`_child.py` execs a fresh `python -I -S -B -X utf8 -c STAGE2` for the program (after rlimits, no_new_privs
and namespaces are in place) and passes this file's source and the job through a memfd: the program's
interpreter never has ctypes loaded (in CPython 3.11 calls through an already-resolved ctypes function raise
no audit event, and `object.__subclasses__()` reaches any loaded class). Standard library only; the trainer
imports it only for the constants.

Start handshake: once the hook is in place, `main` writes `READY` (or the setup error) to the supervisor's
start pipe and waits for its go byte, then closes both pipes and only then runs the program. So the
supervisor reports "started" to the trainer before any of the program's code runs, and a setup error can
only come from here, before the program, on a pipe the program never holds (nothing it prints counts).

The hook sees the events CPython raises for sensitive operations and ends the program (exit status
`BLOCKED_EXIT`, one line starting with `BLOCKED_MARK` on stderr) at the first one outside this policy:
- files: writes (open for writing, create, remove, rename, link, chmod, chown, truncate, utime, xattr,
  sqlite) only inside the working directory (symlinks and `dir_fd` resolved), plus /dev/null,
  /dev/stdout, /dev/stderr; no opening a directory outside it (its fd could anchor `dir_fd=` writes).
  Reads are allowed anywhere the process can see, except other processes' /proc/<pid> entries (their
  environment may hold the trainer's secrets when no private /proc hides them).
- network: only AF_UNIX sockets (asyncio's self-pipe is a socketpair), bound or connected only to paths
  inside the working directory; no name resolution.
- processes: no exec/spawn/system/Popen (`_posixsubprocess.fork_exec`, which raises no event, is replaced
  and its re-import refused); `os.fork` only when `allow_fork` (the kernel caps the count through
  RLIMIT_NPROC in the sandbox's user namespace); signals only to this process unless `allow_kill`
  (a private pid namespace makes every other pid unreachable).
- escapes from the hook itself: no ctypes (import, under any package name, or any `ctypes.*` event), no
  `_test*` modules, no sub-interpreters (they would run without this hook), no gc object enumeration, no
  sys.settrace / sys.setprofile.

This is not a security boundary. Audit hooks see only what CPython reports: operations without an event
(`os.setsid`, `sem_open` in C, ...; `os.mkfifo`, `os.mknod` and the pidfd calls have none either, and the seccomp
filter of `_child.py` refuses them), crafted bytecode (`CodeType.replace` or
`marshal`; asyncio itself needs `code.__new__`, so it stays allowed), interpreter memory bugs, signal
handlers that run while the hook runs (they can see its frame), path objects whose `__fspath__` changes
between the hook and the call, and races between threads get past it. The kernel layers in `_child.py`
(namespaces, read-only mounts, rlimits) are the boundary; the hook makes policy violations fail fast with a
clear status in both modes, and is the only file/network/process policy where namespaces are unavailable.
"""

from __future__ import annotations

import posix
import stat
import sys
import types

BLOCKED_EXIT = 125
BLOCKED_MARK = "hybridflow-sandbox: blocked"
SETUP_EXIT = 3
READY = b"R"
GO = b"G"

_WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
_WRITABLE_DEVICES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})
# top-level module names starting with one of these are refused
_BLOCKED_IMPORTS = ("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_xxinterpchannels",
                    "_test", "cffi")
_BLOCKED_EVENTS = frozenset({
    "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile",
    "cpython.PyInterpreterState_New", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys.settrace", "sys.setprofile", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
    "socket.gethostbyname_ex", "socket.getnameinfo", "syslog.openlog", "syslog.syslog",
})
# event -> ((index of a path argument to check, index of its dir_fd argument or None), ...)
_PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}
_AF_UNIX = 1  # Linux value; importing socket here would slow every sandbox start


# Everything the hook uses is bound to local names when it is built (closure cells), never looked up in
# module globals at call time: the program can reach this module's globals through frames, not the cells.


def _make_resolver(getcwd, lstat, readlink, fsdecode):
    """realpath() from functions captured now, so later monkey-patching of os/posixpath changes nothing."""
    s_islnk = stat.S_ISLNK

    def resolve(path: str, base: str | None = None) -> str:
        if not path.startswith("/"):
            path = (base if base is not None else getcwd()) + "/" + path
        todo = [p for p in reversed(path.split("/")) if p not in ("", ".")]
        parts: list[str] = []
        hops = 0
        while todo:
            name = todo.pop()
            if name == "..":
                if parts:
                    parts.pop()
                continue
            candidate = "/" + "/".join(parts + [name])
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                parts.append(name)  # does not exist (yet): nothing further to resolve here
                continue
            if s_islnk(mode) and hops < 40:
                hops += 1
                target = fsdecode(readlink(candidate))
                if target.startswith("/"):
                    parts = []
                todo.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
                continue
            parts.append(name)
        return "/" + "/".join(parts)

    return resolve


def _fsdecode(value):
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _make_violate():
    write, exit_, mark, code = posix.write, posix._exit, BLOCKED_MARK, BLOCKED_EXIT

    def violate(event: str, detail: object = "") -> None:
        text = detail if isinstance(detail, (str, int)) else type(detail).__name__
        try:
            write(2, f"\n{mark} {event}: {text}\n".encode("utf-8", "replace"))
        except OSError:
            pass  # stderr closed by the program: the exit status alone says blocked
        exit_(code)

    return violate


def _make_path_checks(workdir: str, violate):
    """(checked_path(event, path, dir_fd), on_open(args)) for the working-directory write policy."""
    readlink, stat_, fspath, s_isdir, getpid = posix.readlink, posix.stat, posix.fspath, stat.S_ISDIR, posix.getpid
    fsdecode, writable_devices, write_flags = _fsdecode, _WRITABLE_DEVICES, _WRITE_FLAGS
    resolve = _make_resolver(posix.getcwd, posix.lstat, readlink, fsdecode)
    prefix = workdir.rstrip("/") + "/"

    def inside(path: str) -> bool:
        return path == workdir or path.startswith(prefix)

    def fd_path(fd: int) -> str:
        return fsdecode(readlink(f"/proc/self/fd/{fd}"))

    def checked_path(event: str, path, dir_fd=None) -> None:
        if isinstance(path, int):  # an fd: check the file it refers to
            try:
                target = fd_path(path)
            except OSError:
                return violate(event, f"fd {path} cannot be resolved")
            if target.startswith("/") and target not in writable_devices and not inside(resolve(target)):
                violate(event, target)
            return
        text = fsdecode(fspath(path))
        base = None
        if dir_fd is not None and dir_fd != -1 and not text.startswith("/"):
            try:
                base = fd_path(dir_fd)
            except OSError:
                return violate(event, f"dir_fd {dir_fd} cannot be resolved")
        if text not in writable_devices and not inside(resolve(text, base)):
            violate(event, text)

    def on_open(args) -> None:
        path, mode, flags = args
        if path is None or isinstance(path, int):
            return
        if (flags or 0) & write_flags or (isinstance(mode, str) and any(c in mode for c in "wax+")):
            return checked_path("open", path)
        text = fsdecode(fspath(path))
        if "proc" in text or not text.startswith("/"):  # cheap filter before resolving
            parts = resolve(text).split("/")
            if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != getpid():
                return violate("open", f"another process's /proc entry: {text}")
        try:
            is_dir = s_isdir(stat_(text).st_mode)
        except OSError:
            return
        if is_dir and not inside(resolve(text)):
            violate("open", f"directory outside the working directory: {text}")

    return checked_path, on_open


def _make_handlers(workdir: str, allow_fork: bool, allow_kill: bool, violate) -> types.MappingProxyType:
    """event name -> handler(args) for every event the policy looks at."""
    checked_path, on_open = _make_path_checks(workdir, violate)
    path_events, blocked_imports, af_unix = types.MappingProxyType(dict(_PATH_EVENTS)), _BLOCKED_IMPORTS, _AF_UNIX
    getpid, fsdecode = posix.getpid, _fsdecode

    def on_paths(event: str, args) -> None:
        for index, dir_index in path_events[event]:
            dir_fd = args[dir_index] if dir_index is not None and dir_index < len(args) else None
            checked_path(event, args[index], dir_fd)

    def on_socket_new(args) -> None:
        if args[1] != af_unix:
            violate("socket", f"family {args[1]} (only AF_UNIX socket pairs are allowed)")

    def on_socket_address(event: str, args) -> None:
        address = args[1]
        if address is None and event in ("socket.sendto", "socket.sendmsg"):
            return  # a connected socket: its peer was checked at connect (or it is a socketpair)
        if not isinstance(address, (str, bytes)) or not fsdecode(address) or fsdecode(address)[0] == "\0":
            return violate(event, "only AF_UNIX paths inside the working directory")
        checked_path(event, address)

    def on_kill(event: str, args) -> None:
        if not allow_kill and (event == "os.killpg" or args[0] != getpid()):
            violate(event, f"pid {args[0]}")

    def on_import(args) -> None:
        name, path = args[0], args[1] if len(args) > 1 else None
        if isinstance(name, str) and any(part.startswith(blocked_imports) for part in name.split(".")):
            violate("import", name)
        if isinstance(path, str) and path.rsplit("/", 1)[-1].startswith(blocked_imports):
            violate("import", path)  # an extension module loaded by file under another name

    def on_sqlite(args) -> None:
        if isinstance(args[0], (str, bytes)) and fsdecode(args[0]) not in ("", ":memory:"):
            checked_path("sqlite3.connect", args[0])

    def on_fork(event: str, args) -> None:
        if not allow_fork:
            violate(event, "process creation is disabled without a private pid namespace")

    return types.MappingProxyType({
        "open": on_open, "socket.__new__": on_socket_new, "import": on_import, "sqlite3.connect": on_sqlite,
        **{e: (lambda a, e=e: on_paths(e, a)) for e in _PATH_EVENTS},
        **{e: (lambda a, e=e: on_socket_address(e, a))
           for e in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")},
        **{e: (lambda a, e=e: on_kill(e, a)) for e in ("os.kill", "os.killpg")},
        **{e: (lambda a, e=e: on_fork(e, a)) for e in ("os.fork", "os.forkpty")},
        **{e: (lambda a, e=e: violate(e, "not allowed in the sandbox")) for e in _BLOCKED_EVENTS},
    })


def install(workdir: str, *, allow_fork: bool, allow_kill: bool) -> None:
    """Replace `_posixsubprocess.fork_exec` and add the audit hook (it cannot be removed afterwards)."""
    import _posixsubprocess  # imported now so that a later import of it raises an event (a re-import)

    violate = _make_violate()
    get = _make_handlers(workdir, allow_fork, allow_kill, violate).get

    def hook(event: str, args: tuple) -> None:
        handler = get(event)
        if handler is not None:
            handler(args)
        elif event.startswith("ctypes."):
            violate(event, "ctypes is not allowed in the sandbox")

    def fork_exec_blocked(*args, **kwargs):
        violate("subprocess", "starting programs is not allowed in the sandbox")

    _posixsubprocess.fork_exec = fork_exec_blocked
    sys.addaudithook(hook)


def _exit_status(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code & 0xFF
    print(err.code, file=sys.stderr)
    return 1


def _finish(status: int) -> int:
    """What interpreter shutdown does first: join threads, run atexit, flush (exit 120 if that fails)."""
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()
    except BaseException:  # the program's own failure while joining; reported like Python does
        sys.excepthook(*sys.exc_info())
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            status = status or 120
    return status


def run_program(source: str, after=None) -> None:
    """Run `source` as `__main__` (filename `<sandbox>`), then `after(namespace)` if it ended normally, then
    exit the process with its status."""
    import builtins

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = ["<sandbox>"]
    status = 0
    try:
        exec(compile(source, "<sandbox>", "exec"), main.__dict__)
        if after is not None:
            after(main.__dict__)
    except SystemExit as err:
        status = _exit_status(err)
    except BaseException as err:  # print the program's traceback without this file's frame
        if err.__traceback__ is not None:
            err.__traceback__ = err.__traceback__.tb_next
        sys.excepthook(type(err), err, err.__traceback__)
        status = 1
    posix._exit(_finish(status))


def _harness_server(job: dict):
    """`after` for a run with tests: serve the harness (see `_harness.py`) on the job's two pipes."""
    harness = types.ModuleType("_hybridflow_sandbox_harness")
    exec(compile(job["harness"], "<sandbox-harness>", "exec"), harness.__dict__)
    serve, requests_fd, answers_fd = harness.serve, job["requests_fd"], job["answers_fd"]
    return lambda namespace: serve(namespace, requests_fd, answers_fd)


def main(job: dict) -> None:
    """Entry point in the program's interpreter: job = {code, work_dir, allow_fork, allow_kill, start_fd,
    go_fd, harness (source or None), requests_fd, answers_fd}."""
    start_fd, go_fd = job["start_fd"], job["go_fd"]
    try:
        posix.chdir(job["work_dir"])
        source = job.pop("code")
        after = _harness_server(job) if job.get("harness") else None
        install(job["work_dir"], allow_fork=job["allow_fork"], allow_kill=job["allow_kill"])
    except BaseException as err:
        posix.write(start_fd, f"{type(err).__name__}: {err}".encode("utf-8", "replace")[:2000])
        posix._exit(SETUP_EXIT)
    posix.write(start_fd, READY)
    go = posix.read(go_fd, 1)
    posix.close(start_fd)
    posix.close(go_fd)
    if go != GO:
        posix._exit(SETUP_EXIT)  # the supervisor is gone: never run the program unreported
    del job, start_fd, go_fd
    run_program(source, after)
