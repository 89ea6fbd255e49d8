"""Bootstrap of one sandboxed run: `runner.py` starts `python -I -S -B -X utf8 _child.py JOB_FILE REPORT_FD`.

Standard library only, never imported by the trainer. Reads (and deletes) the job file, sets up isolation,
runs the program and writes one JSON report line per event to REPORT_FD (a pipe only the trainer reads and
the program never holds).

Process tree with namespaces (`isolation='namespaces'`, the default; required):
    trainer -> P0 (new user, mount, net, ipc, uts, cgroup namespaces) -> R (pid 1 of a new pid namespace) -> U [, H]
- P0 first joins the sandbox's memory cgroup when the trainer made one (`_cgroup.py`), then unshares, maps
  ids and waits for R. When the trainer runs as root, a short-lived helper forked before the unshare maps the
  namespace to uid/gid `job["sandbox_uid"]` (nobody) in the parent namespace, so the program holds no
  root-owned file rights and RLIMIT_NPROC applies (the kernel exempts real root from it); otherwise the
  trainer's own uid is mapped. If the kernel refuses the namespaces, P0 reports a setup error (the trainer
  raises `SandboxError` naming the setting) and nothing runs: there is no fallback.
- R ignores every signal (so the program cannot stop or confuse its pid 1), sets the namespace's
  user.max_user_namespaces to 0 (no nested user namespace, so no capabilities for the program anywhere) and
  builds a new root on a tmpfs:
  read-only bind mounts of /usr, /etc, /bin, /sbin, /lib* and the Python installation, the working directory
  as a private tmpfs of `disk_mb` holding the job's files, a minimal /dev (null, zero, full, random,
  urandom, a small /dev/shm), a fresh read-only /proc that shows only the sandbox's processes; it
  pivot_roots into it and detaches the old root. Everything else (home directories, /run, /var, other
  sandboxes' directories, unix sockets of host services) is absent. R then supervises U; when U exits, R
  exits and the kernel kills every process left in the pid namespace (daemonised grandchildren included).
- U drops all capabilities, sets no_new_privs, the seccomp filter (`_SECCOMP`) and the rlimits, execs a
  fresh interpreter that installs the audit hook (`_runtime.py`), tells R it is ready on the start pipe,
  waits for R's go, then runs the program as `__main__` with filename `<sandbox>`. Its parent pid is 1 (R),
  which it cannot signal.
- H (only for a run with tests) is forked by R before U and runs the test code against the program over two
  pipes (`_harness.py`); it reports the verdict on the report pipe, which U never holds.
The net namespace has only a down loopback device: no network at all.

Without namespaces (`isolation='none'`): trainer -> P0 -> U [, H], same rlimits, seccomp filter, exec, handshake
and audit hook; P0 is the supervisor (not dumpable, ignoring signals), the working directory is on the trainer's disk,
and the hook also refuses `os.fork` (no kernel process cap) and signals to other processes.
"""

from __future__ import annotations

import base64
import json
import math
import os
import resource
import signal
import sys

SETUP_EXIT = 3
READY, GO = b"R", b"G"  # the start handshake with `_runtime.main` (the same bytes there)
_MAX_ANSWER_BYTES = 1 << 24  # the longest answer from the program the test harness reads
# NS UTS IPC USER PID NET CGROUP (the cgroup namespace last joined: /proc/self/cgroup shows '/', no host path)
_CLONE_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_STRICTATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 24
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
# A seccomp filter in U, the program's process (machine -> audit arch, clone's number, syscalls refused with
# EPERM: memfd_create, then shmget and msgget (memory outside RLIMIT_AS), unshare, setns, then mknod(at) (a FIFO
# or file where the trainer will open one; the audit hook sees no event for it), pidfd_open, pidfd_send_signal
# and pidfd_getfd (signals and file descriptors of other processes past the hook's os.kill check)). `clone` with a
# namespace flag is refused too, `clone3` answers ENOSYS (its flags sit behind a pointer; glibc then falls back
# to clone), and other architectures' syscalls (x32, i386 on x86_64) are refused. So memory the program holds
# is its address space, its files (the working directory's tmpfs, /dev/shm) and kernel buffers; see
# SandboxLimits.
_SECCOMP = {"x86_64": (0xC000003E, 56, (319, 29, 68, 272, 308, 133, 259, 434, 424, 438)),
            "aarch64": (0xC00000B7, 220, (279, 194, 186, 97, 268, 33, 434, 424, 438))}
_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The `_SECCOMP` filter for `machine` as classic BPF (code, jt, jf, k) over seccomp_data (nr at offset 0,
    arch at 4, the first argument's low half at 16 on these little-endian machines)."""
    arch, clone, denied = _SECCOMP[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    code = [(ld, 0, 0, 4), (jeq, 0, "deny", arch), (ld, 0, 0, 0)]
    code += [(jge, "deny", 0, 0x40000000)] * (machine == "x86_64")  # the x32 ABI's numbers
    code += [(jeq, "deny", 0, nr) for nr in denied]
    code += [(jeq, "enosys", 0, 435), (jeq, 0, "allow", clone),  # clone3; clone without namespace flags
             (ld, 0, 0, 16), (jset, "deny", "allow", _NEW_NAMESPACES)]
    labels = {"allow": len(code), "deny": len(code) + 1, "enosys": len(code) + 2}
    code += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x00050000 | 38)]  # EPERM, ENOSYS
    return [(op, labels[jt] - i - 1 if jt else 0, labels[jf] - i - 1 if jf else 0, k)
            for i, (op, jt, jf, k) in enumerate(code)]


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

    def install_seccomp(self, machine: str) -> None:
        """Install `seccomp_program(machine)` in this process (it needs no_new_privs); exec keeps it."""
        ct, program = self._ctypes, seccomp_program(machine)

        class Instruction(ct.Structure):
            _fields_ = [("code", ct.c_ushort), ("jt", ct.c_ubyte), ("jf", ct.c_ubyte), ("k", ct.c_uint32)]

        class Program(ct.Structure):
            _fields_ = [("len", ct.c_ushort), ("filter", ct.POINTER(Instruction))]

        instructions = (Instruction * len(program))(*[Instruction(*ins) for ins in program])
        self("prctl", 22, 2, ct.byref(Program(len(program), instructions)), 0, 0)  # PR_SET_SECCOMP, MODE_FILTER

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
    """Bind the O_PATH `fd` at cwd-relative `.target`: 'ro' (recursive, every submount read-only) or 'dev'
    (a device node)."""
    relative = "." + target
    if kind == "dev":
        os.close(os.open(relative, os.O_CREAT | os.O_WRONLY, 0o644))
    else:
        os.makedirs(relative, exist_ok=True)
    libc.mount(f"/proc/self/fd/{fd}", relative, None, _MS_BIND | (_MS_REC if kind == "ro" else 0))
    os.close(fd)
    for point, options in _mounts_under(root, target):
        flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _locked_flags(options)
        flags |= {"ro": _MS_RDONLY | _MS_NODEV, "dev": _MS_NOEXEC}[kind]
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
    work, disk_mb = "." + job["work_dir"], job["limits"]["disk_mb"]
    os.makedirs(work, exist_ok=True)  # the quota: all the program's files share one tmpfs of disk_mb
    libc.mount("tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
               f"mode=0700,size={disk_mb}m,nr_inodes={max(1024, disk_mb * 256)}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"./dev/{name}")
    os.mkdir("./dev/shm")
    libc.mount("tmpfs", "./dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
               f"mode=1777,size={job['limits']['file_size_mb']}m")
    layers = ["user_ns", "net_ns", "pid_ns", "ipc_ns", "uts_ns", "mount_ns", "cgroup_ns", "readonly_root",
              "workdir_tmpfs"]
    try:  # no user namespaces of the program's own: in one it would hold every capability (mount a tmpfs past
        # disk_mb, ...). The limit is per user namespace, and R holds CAP_SYS_RESOURCE in the sandbox's.
        _write_file("/proc/sys/user/max_user_namespaces", "0")
        layers.append("no_nested_userns")
    except OSError:
        pass  # e.g. a container with a read-only /proc/sys: the layer is absent from the result's `isolation`
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


def _set_rlimits(limits: dict, isolated: bool, harness: bool) -> None:
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
    if isolated:  # counted per user namespace; + P0, R (and H), which share the namespace's uid: the program
        # gets exactly max_processes, as under the pids cgroup (`runner._prepare`)
        lower(resource.RLIMIT_NPROC, limits["max_processes"] + 2 + harness)


def _set_signals(handler) -> None:
    """Every signal a process may catch to `handler` (SIGCHLD stays default: ignoring it would auto-reap)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            continue
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            continue  # 32 and 33: reserved by the C library, not deliverable to Python


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


def _job_memfd(job: dict, sources: dict, isolated: bool, fds: dict) -> int:
    fd = os.memfd_create("hybridflow-sandbox-job", 0)  # no MFD_CLOEXEC: the program's interpreter reads it
    payload = {"code": job["code"], "work_dir": job["work_dir"], "allow_fork": isolated, "allow_kill": isolated,
               "runtime": sources["runtime"], "harness": sources.get("harness"), **fds}
    os.write(fd, json.dumps(payload).encode())
    return fd


def _exec_program(libc: _Libc | None, job: dict, sources: dict, isolated: bool, fds: dict) -> None:
    """U: lock the process down and exec the program's interpreter. Never returns. A failure before the exec
    goes to the start pipe (`fds['start_fd']`), which the supervisor turns into a setup error."""
    try:
        _set_signals(signal.SIG_DFL)  # R ignores every signal; the program starts with the defaults
        if libc is not None:
            libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if isolated:
                libc.drop_capabilities()
            libc("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir(job["work_dir"])
        memfd = _job_memfd(job, sources, isolated, fds)
        if libc is not None and os.uname().machine in _SECCOMP:  # after the job's memfd, under no_new_privs
            libc.install_seccomp(os.uname().machine)
        for fd in fds.values():
            os.set_inheritable(fd, True)
        os.set_inheritable(_report_fd(), False)  # the program never holds the report pipe
        _set_rlimits(job["limits"], isolated, job.get("tests") is not None)
        python = os.path.realpath(sys.executable)
        os.execv(python, [python, "-I", "-S", "-B", "-X", "utf8", "-c", _STAGE2, str(memfd)])
    except BaseException as err:
        os.write(fds["start_fd"], f"program start: {type(err).__name__}: {err}".encode()[:2000])
    os._exit(SETUP_EXIT)


def _run_harness(libc: _Libc | None, job: dict, sources: dict, isolated: bool, requests_fd: int,
                 answers_fd: int) -> None:
    """H: run the job's tests against the program (`_harness.py`) and report the verdict. Never returns.
    Forked from the supervisor, so it is not dumpable and ignores signals; the program cannot reach it."""
    try:
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        if libc is not None:
            libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if isolated:
                libc.drop_capabilities()
            libc("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir("/")
        _set_rlimits(job["limits"], isolated, True)
        harness = type(sys)("_hybridflow_sandbox_harness")
        exec(compile(sources["harness"], "<sandbox-harness>", "exec"), harness.__dict__)
        verdict = harness.run_tests(job["tests"], requests_fd, answers_fd, _MAX_ANSWER_BYTES,
                                    job.get("test_setup"), job.get("program_names"))
    except BaseException as err:  # the harness's own failure: the tests did not pass
        verdict = {"passed": False, "started": False, "detail": f"harness: {type(err).__name__}: {err}"[:500]}
    _report(tests=verdict)
    os._exit(0)


def _start(libc: _Libc | None, job: dict, sources: dict, isolated: bool) -> tuple[int, int | None, int, int]:
    """Fork H (with tests) and U; returns (U's pid, H's pid, start pipe's read end, go pipe's write end)."""
    fds, harness_pid = {}, None
    if job.get("tests") is not None:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        harness_pid = os.fork()
        if harness_pid == 0:
            os.close(requests_r)
            os.close(answers_w)
            _run_harness(libc, job, sources, isolated, requests_w, answers_r)
        os.close(requests_w)
        os.close(answers_r)
        fds.update(requests_fd=requests_r, answers_fd=answers_w)
    start_r, start_w = os.pipe()
    go_r, go_w = os.pipe()
    fds.update(start_fd=start_w, go_fd=go_r)
    pid = os.fork()
    if pid == 0:
        os.close(start_r)
        os.close(go_w)
        _exec_program(libc, job, sources, isolated, fds)
    for fd in fds.values():
        os.close(fd)
    return pid, harness_pid, start_r, go_w


def _supervise(libc: _Libc | None, job: dict, sources: dict, isolated: bool, **facts) -> None:
    """Report the isolation facts, start U (and H), let U run the program once it reported ready, wait for
    them (as pid 1, reaping orphans meanwhile), report how U ended. Never returns.

    The trainer trusts a setup error only before 'started'; 'started' is reported before U may run a line
    of the program (U waits for the go byte), so nothing the program does can pass for a setup error."""
    _report(**facts)
    pid, harness_pid, start_r, go_w = _start(libc, job, sources, isolated)
    _detach_stdio()
    ready = os.read(start_r, 4096)
    os.close(start_r)
    if ready != READY:
        _, status = os.waitpid(pid, 0)
        if harness_pid is not None:
            os.kill(harness_pid, signal.SIGKILL)
        detail = ready.decode("utf-8", "replace") or f"the interpreter ended first (wait status {status})"
        _report(setup_error=f"program start: {detail}")
        os._exit(SETUP_EXIT)
    _report(started=True)
    os.write(go_w, GO)
    os.close(go_w)
    waiting = {pid} if harness_pid is None else {pid, harness_pid}
    status, usage = 0, None
    while waiting:
        done, done_status, done_usage = os.wait4(-1 if isolated else next(iter(waiting)), 0)
        if done == pid:
            status, usage = done_status, done_usage
        waiting.discard(done)
    exited = os.WIFEXITED(status)
    _report(exit_code=os.WEXITSTATUS(status) if exited else None,
            signal=None if exited else os.WTERMSIG(status),
            cpu_s=round(usage.ru_utime + usage.ru_stime, 4))
    os._exit(0)


def _write_files(job: dict) -> None:
    """The job's input files, into the working directory (R: its tmpfs; P0 without namespaces: the disk)."""
    for name, content in job["files"].items():
        path = os.path.join(job["work_dir"], name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(content))


def _init_process(libc: _Libc, job: dict, sources: dict, binds: dict) -> None:
    """R, pid 1 of the new pid namespace. Never returns."""
    try:
        _set_signals(signal.SIG_IGN)  # the program may signal its pid 1: nothing it sends does anything
        libc("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        layers = _build_root(libc, job, binds)
        libc("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)  # U may not open /proc/1/fd (the report pipe)
        _write_files(job)
    except BaseException as err:
        _fail_setup(f"namespace setup: {type(err).__name__}: {err}")
    _supervise(libc, job, sources, True, layers=layers + ["rlimits", "nproc", "audit_hook"] + _seccomp_layer(libc))


def _seccomp_layer(libc: _Libc | None) -> list[str]:
    """['seccomp'] where U installs the filter (it fails its start rather than run without it)."""
    return ["seccomp"] if libc is not None and os.uname().machine in _SECCOMP else []


def _fail_setup(message: str, **facts) -> None:
    _report(setup_error=message, **facts)
    os._exit(SETUP_EXIT)


def _enter_cgroup(job: dict) -> None:
    """P0, first thing: into the sandbox's memory cgroup (the trainer made it), so every process starts there;
    and first in line for the OOM killer, before the trainer (raising one's own score needs no privilege)."""
    if job["cgroup"]:
        _write_file(os.path.join(job["cgroup"], "cgroup.procs"), str(os.getpid()))
    try:
        _write_file("/proc/self/oom_score_adj", "1000")
    except OSError:
        return  # a /proc that refuses it (some containers): a preference, not a limit; the caps still hold


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        job = json.load(handle)
    os.unlink(sys.argv[1])  # the program must not find the source, its tests or its files on disk
    _enter_cgroup(job)
    here = os.path.dirname(os.path.abspath(__file__))
    sources = {}  # read now: after pivot_root these files are out of sight
    for name in ("runtime", "harness") if job.get("tests") is not None else ("runtime",):
        with open(os.path.join(here, f"_{name}.py"), encoding="utf-8") as handle:
            sources[name] = handle.read()
    try:
        libc = _Libc()
    except (ImportError, OSError) as err:  # a Python built without ctypes: no namespaces, no pdeathsig
        libc, libc_error = None, f"ctypes unavailable: {err}"
    if job["isolation"] == "namespaces":
        if libc is None:
            _fail_setup(libc_error, namespaces_unavailable=True)
        try:
            binds = _enter_namespaces(libc, job)
        except LookupError as err:
            _fail_setup(f"unshare refused: {err}", namespaces_unavailable=True)
        pid = os.fork()
        if pid == 0:
            _init_process(libc, job, sources, binds)
        os.close(_report_fd())
        _detach_stdio()
        os.waitpid(pid, 0)
        os._exit(0)
    if libc is not None:
        libc("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not open /proc/<P0>/fd or its memory
    _set_signals(signal.SIG_IGN)
    _write_files(job)
    _supervise(libc, job, sources, False, layers=["rlimits", "audit_hook"] + _seccomp_layer(libc))


if __name__ == "__main__":
    try:
        main()
    except BaseException as error:  # anything before the program starts is the sandbox's failure, not its
        _report(setup_error=f"bootstrap: {type(error).__name__}: {error}")
        os._exit(SETUP_EXIT)
