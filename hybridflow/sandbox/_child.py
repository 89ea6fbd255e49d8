"""Bootstrap of one sandboxed run: `runner.py` starts `python -I -S -B -X utf8 _child.py JOB_FILE`.

Standard library only, never imported by the trainer. Reads (and deletes) the job file, sets up isolation,
runs the program and writes one JSON report line per event to fd 3 (a pipe only the trainer reads).

Process tree with namespaces (the default where unprivileged user namespaces work):
    trainer -> P0 (new user, mount, net, ipc, uts namespaces) -> R (pid 1 of a new pid namespace) -> U
- P0 unshares, maps ids and waits for R. When the trainer runs as root, a short-lived helper forked before
  the unshare maps the namespace to uid/gid `job["sandbox_uid"]` (nobody) in the parent namespace, so the
  program holds no root-owned file rights and RLIMIT_NPROC applies (the kernel exempts real root from it);
  otherwise the trainer's own uid is mapped.
- R builds a new root on a tmpfs: read-only bind mounts of /usr, /etc, /bin, /sbin, /lib* and the Python
  installation, a read-write bind of the working directory, a minimal /dev (null, zero, full, random,
  urandom, a small /dev/shm), a fresh read-only /proc that shows only the sandbox's processes; it
  pivot_roots into it and detaches the old root. Everything else (home directories, /run, /var, other
  sandboxes' directories, unix sockets of host services) is absent. R then supervises U; when U exits, R
  exits and the kernel kills every process left in the pid namespace (daemonised grandchildren included).
- U drops all capabilities, sets no_new_privs, the rlimits and the audit hook (`_guard.py`), then runs the
  program as `__main__` with filename `<sandbox>`. Its parent pid is 1 (R), which it cannot signal.
The net namespace has only a down loopback device: no network at all.

Without namespaces (unshare refused, or `use_namespaces=False`): trainer -> P0 -> U, same rlimits, exec and
audit hook; the hook then also refuses `os.fork` (no kernel process cap) and signals to other processes.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys

SETUP_EXIT = 3
_CLONE_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000  # NS UTS IPC USER PID NET
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_STRICTATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 24
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")


class _Libc:
    """The few libc calls the standard library lacks (unshare, mount, pivot_root, prctl, capset)."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._lib = ctypes.CDLL(None, use_errno=True)

    def __call__(self, name: str, *args) -> int:
        ct = self._ctypes
        converted = [a.encode() if isinstance(a, str) else a for a in args]
        result = getattr(self._lib, name)(*[ct.c_ulong(a) if isinstance(a, int) and a > 0x7FFFFFFF else a
                                           for a in converted])
        if result == -1:
            err = ct.get_errno()
            raise OSError(err, f"{name}{tuple(args)!r}: {os.strerror(err)}")
        return result

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        self("mount", source, target, fstype, self._ctypes.c_ulong(flags), data)

    def drop_capabilities(self) -> None:
        """Empty the bounding set (so no exec can regain capabilities) and the current sets."""
        ct = self._ctypes
        for cap in range(64):
            if self._lib.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # EINVAL: past the last capability this kernel knows
        header = (ct.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ct.c_uint32 * 6)()
        self("capset", ct.byref(header), ct.byref(data))


def _report_fd() -> int:
    return int(sys.argv[2])  # the trainer's report pipe (inherited at its own number)


def _report(**fields) -> None:
    os.write(_report_fd(), (json.dumps(fields) + "\n").encode())


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _detach_stdio() -> None:
    """Let go of the program's pipes, so the trainer sees EOF as soon as the program's processes are gone."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _start_id_mapper(sandbox_id: int):
    """Fork a helper that stays in the parent user namespace (as root) and maps `sandbox_id` for us once
    we have unshared. Returns go(): run the mapping and raise if it failed."""
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(done_r)
        status = b"-"
        try:
            if os.read(go_r, 1) == b"x":
                target = os.getppid()
                _write_file(f"/proc/{target}/uid_map", f"{sandbox_id} {sandbox_id} 1")
                _write_file(f"/proc/{target}/gid_map", f"{sandbox_id} {sandbox_id} 1")
                status = b"k"
        finally:
            os.write(done_w, status)
            os._exit(0)
    os.close(go_r)
    os.close(done_w)

    def go(ready: bool) -> None:
        os.write(go_w, b"x" if ready else b"-")
        os.close(go_w)
        answer = os.read(done_r, 1)
        os.waitpid(pid, 0)
        if ready and answer != b"k":
            raise OSError("the id-mapping helper could not write uid_map/gid_map")

    return go


def _bind_sources(job: dict) -> dict[str, tuple[str, int]]:
    """target path -> (kind, O_PATH fd), opened inside the new mount namespace before ids change (the
    Python installation may sit under a directory only the trainer's uid can enter, such as /root)."""
    paths: list[str] = [p for p in _SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)]
    for extra in (sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(extra)
        if not any(real == p or real.startswith(p + "/") for p in paths):
            paths.append(real)
    sources = {p: ("ro", os.open(p, os.O_PATH)) for p in paths}
    sources.update({f"/dev/{d}": ("dev", os.open(f"/dev/{d}", os.O_PATH)) for d in _DEVICES})
    sources[job["work_dir"]] = ("rw", os.open(job["work_dir"], os.O_PATH))
    return sources


def _enter_namespaces(libc: _Libc, job: dict) -> dict[str, tuple[str, int]]:
    """Unshare, mount the new root's tmpfs and make it the cwd, open the bind sources, map ids.

    Raises `LookupError` (nothing changed yet) if namespaces are unavailable. Everything that walks paths
    under the trainer's private directories happens before the switch to the sandbox uid; what follows
    uses paths relative to the cwd (the new root).
    """
    uid, gid = os.geteuid(), os.getegid()
    go = _start_id_mapper(job["sandbox_uid"]) if uid == 0 else None
    try:
        libc("unshare", _CLONE_FLAGS)
    except OSError as err:
        if go is not None:
            go(False)
        raise LookupError(str(err)) from err
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    new_root = os.path.join(job["base_dir"], "root")
    os.mkdir(new_root, 0o755)
    # mode 0777: until ids are mapped the tmpfs root belongs to an unmapped uid; it is read-only later
    libc.mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0777,size=8m")
    os.chdir(new_root)
    sources = _bind_sources(job)
    if go is not None:
        go(True)
        sandbox_id = job["sandbox_uid"]
        os.setgroups([])
        os.setresgid(sandbox_id, sandbox_id, sandbox_id)
        os.setresuid(sandbox_id, sandbox_id, sandbox_id)
    else:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    return sources


def _unescape(field: str) -> str:
    """mountinfo's octal escapes. (No codec lookups here: after the uid switch and before pivot_root the
    standard library may sit under a directory the sandbox uid cannot enter, so nothing new can be imported.)"""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts_under(root: str, target: str) -> list[tuple[str, list[str]]]:
    """(cwd-relative mount point, per-mount options) of `target` and the mounts below it, in mount order."""
    prefix = root + target
    found: dict[str, list[str]] = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            point = _unescape(fields[4])
            if point == prefix or point.startswith(prefix + "/"):
                found["." + point[len(root):]] = fields[5].split(",")  # the last mount at a point is on top
    return list(found.items())


def _locked_flags(options: list[str]) -> int:
    """Flags a bind remount must repeat (in a user namespace the kernel refuses to clear them)."""
    return (_MS_NOEXEC * ("noexec" in options) | _MS_NOATIME * ("noatime" in options)
            | _MS_NODIRATIME * ("nodiratime" in options)
            | _MS_STRICTATIME * ("relatime" not in options and "noatime" not in options))


def _bind(libc: _Libc, root: str, fd: int, target: str, kind: str) -> None:
    """Bind the O_PATH `fd` at cwd-relative `.target`: 'ro' (recursive, every submount read-only), 'rw'
    (the working directory) or 'dev' (a device node)."""
    relative = "." + target
    if kind == "dev":
        os.close(os.open(relative, os.O_CREAT | os.O_WRONLY, 0o644))
    else:
        os.makedirs(relative, exist_ok=True)
    libc.mount(f"/proc/self/fd/{fd}", relative, None, _MS_BIND | (_MS_REC if kind == "ro" else 0))
    os.close(fd)
    for point, options in _mounts_under(root, target):
        flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _locked_flags(options)
        flags |= {"ro": _MS_RDONLY | _MS_NODEV, "rw": _MS_NODEV, "dev": _MS_NOEXEC}[kind]
        libc.mount(None, point, None, flags)


def _build_root(libc: _Libc, job: dict, sources: dict[str, tuple[str, int]]) -> list[str]:
    """In R, cwd = the new root's tmpfs: fill it, pivot into it; returns the layers set up."""
    root = os.path.join(job["base_dir"], "root")
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):
            os.symlink(os.readlink(top), "." + top)
    os.mkdir("./dev")
    libc.mount("tmpfs", "./dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "mode=0755,size=64k")
    for target, (kind, fd) in sources.items():
        _bind(libc, root, fd, target, kind)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"./dev/{name}")
    os.mkdir("./dev/shm")
    libc.mount("tmpfs", "./dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
               f"mode=1777,size={job['limits']['file_size_mb']}m")
    layers = ["user_ns", "net_ns", "pid_ns", "ipc_ns", "uts_ns", "mount_ns", "readonly_root"]
    os.mkdir("./proc")
    try:
        libc.mount("proc", "./proc", "proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        layers.append("private_proc")
    except OSError:
        pass  # e.g. a container that masks parts of /proc: the sandbox then has no /proc at all
    os.makedirs("./tmp", exist_ok=True)
    libc("syscall", _SYS_PIVOT_ROOT[os.uname().machine], ".", ".")  # old root stacked on top of new
    libc("umount2", ".", _MNT_DETACH)  # ... and detached: nothing of the host's tree remains reachable
    os.chdir("/")
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    libc.mount(None, "/dev", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC)
    libc("sethostname", "sandbox", 7)
    return layers


def _set_rlimits(limits: dict, isolated: bool) -> None:
    def lower(which: int, value: int, hard: int | None = None) -> None:
        _, current_hard = resource.getrlimit(which)
        hard = value if hard is None else hard
        if current_hard != resource.RLIM_INFINITY:
            value, hard = min(value, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (value, hard))

    cpu = max(1, math.ceil(limits["cpu_time_s"]))
    lower(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit, SIGKILL one second later
    lower(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    lower(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
    lower(resource.RLIMIT_CORE, 0)
    lower(resource.RLIMIT_NOFILE, 256)
    if isolated:  # counted per user namespace; +2 for P0 and R, which share the namespace's uid
        lower(resource.RLIMIT_NPROC, limits["max_processes"] + 2)


# Runs in the program's fresh interpreter: load the runtime (the audit hook) from the memfd, then the program.
_STAGE2 = """import json, os, sys
fd = int(sys.argv[1])
job = json.loads(os.pread(fd, os.fstat(fd).st_size, 0))
os.close(fd)
runtime = type(sys)("_hybridflow_sandbox_runtime")
exec(compile(job.pop("runtime"), "<sandbox-runtime>", "exec"), runtime.__dict__)
del fd, json
runtime.main(job)
"""


def _job_memfd(job: dict, runtime: str, isolated: bool) -> int:
    fd = os.memfd_create("hybridflow-sandbox-job", 0)  # no MFD_CLOEXEC: the program's interpreter reads it
    payload = {"code": job["code"], "work_dir": job["work_dir"], "allow_fork": isolated,
               "allow_kill": isolated, "runtime": runtime}
    os.write(fd, json.dumps(payload).encode())
    return fd


def _exec_program(libc: _Libc | None, job: dict, runtime: str, isolated: bool) -> None:
    """U: lock the process down and exec the program's interpreter. Never returns."""
    try:
        if libc is not None:
            libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if isolated:
                libc.drop_capabilities()
            libc("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir(job["work_dir"])
        memfd = _job_memfd(job, runtime, isolated)
        os.set_inheritable(_report_fd(), False)  # closed by the exec; open to report a failed exec
        _set_rlimits(job["limits"], isolated)
        python = os.path.realpath(sys.executable)
        os.execv(python, [python, "-I", "-S", "-B", "-X", "utf8", "-c", _STAGE2, str(memfd)])
    except BaseException as err:
        _report(setup_error=f"program start: {type(err).__name__}: {err}")
    os._exit(SETUP_EXIT)


def _supervise(libc: _Libc | None, job: dict, runtime: str, isolated: bool, **facts) -> None:
    """Report the isolation facts, fork U, wait for it (as pid 1, reaping orphans meanwhile), report how it
    ended. Never returns."""
    _report(**facts)
    pid = os.fork()
    if pid == 0:
        _exec_program(libc, job, runtime, isolated)
    _detach_stdio()
    while True:
        try:
            done, status, usage = os.wait4(-1 if isolated else pid, 0)
        except ChildProcessError:
            os._exit(SETUP_EXIT)
        if done == pid:
            break
    exited = os.WIFEXITED(status)
    _report(exit_code=os.WEXITSTATUS(status) if exited else None,
            signal=None if exited else os.WTERMSIG(status),
            cpu_s=round(usage.ru_utime + usage.ru_stime, 4))
    os._exit(0)


def _init_process(libc: _Libc, job: dict, runtime: str, sources: dict) -> None:
    """R, pid 1 of the new pid namespace. Never returns."""
    try:
        libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        layers = _build_root(libc, job, sources)
        libc("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)  # U may not open /proc/1/fd (the report pipe)
    except BaseException as err:
        _report(setup_error=f"namespace setup: {type(err).__name__}: {err}")
        os._exit(SETUP_EXIT)
    _supervise(libc, job, runtime, True, layers=layers + ["rlimits", "nproc", "audit_hook"])


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        job = json.load(handle)
    os.unlink(sys.argv[1])  # the program must not find the source (or anything appended to it) on disk
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runtime.py"), encoding="utf-8") as handle:
        runtime = handle.read()  # read now: after pivot_root this file is out of sight
    try:
        libc = _Libc()
    except (ImportError, OSError) as err:  # a Python built without ctypes: no namespaces, no pdeathsig
        libc, ns_error = None, f"ctypes unavailable: {err}"
    else:
        ns_error = None if job["use_namespaces"] else "disabled (use_namespaces=False)"
    if libc is not None and ns_error is None:
        try:
            sources = _enter_namespaces(libc, job)
        except LookupError as err:
            ns_error = f"unshare refused: {err}"
        else:
            pid = os.fork()
            if pid == 0:
                _init_process(libc, job, runtime, sources)
            os.close(_report_fd())
            _detach_stdio()
            os.waitpid(pid, 0)
            os._exit(0)
    _supervise(libc, job, runtime, False, layers=["rlimits", "audit_hook"], namespace_error=ns_error)


if __name__ == "__main__":
    try:
        main()
    except BaseException as error:  # anything before the program starts is the sandbox's failure, not its
        _report(setup_error=f"bootstrap: {type(error).__name__}: {error}")
        os._exit(SETUP_EXIT)
