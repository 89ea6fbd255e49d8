"""What a sandboxed run may use (`SandboxLimits`) and how it ended (`SandboxResult`, `HarnessVerdict`,
`SandboxError`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["HarnessVerdict", "IsolationMode", "SandboxError", "SandboxLimits", "SandboxResult", "SandboxStatus"]

SandboxStatus = Literal["ok", "error", "timeout", "memory", "output_limit", "killed", "blocked"]
IsolationMode = Literal["namespaces", "none"]
RunPlace = Literal["namespaces", "none", "remote"]
"""Where a run happened: a local sandbox's `IsolationMode`, or 'remote' (a SandboxFusion server)."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (the interpreter could not start, or isolation could not be set up); the
    program did not run. A program's own failures are results, never this exception."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resources one run may use. Every limit applies to the program and each process it forks.

    Memory: each process's address space is capped at `memory_mb` (RLIMIT_AS). Where the trainer can create
    a memory cgroup (cgroup v2 with the memory controller delegated, or a writable cgroup v1 memory
    hierarchy), the whole sandbox's resident memory, its in-memory files included, is also capped at
    `memory_mb + disk_mb` (status 'memory' when the kernel's OOM killer stops it). Without one, the bound on
    the whole sandbox is `memory_mb * max_processes + disk_mb + file_size_mb` (address space of every
    process, plus the working directory and /dev/shm tmpfs files). It holds because memory outside the
    address space is refused by a seccomp filter (x86_64 and aarch64: memfd_create, System V shmget and
    msgget); kernel buffers of pipes and sockets are not counted (the kernel caps pipes per user at
    fs.pipe-user-pages-soft, 64 MiB by default, and each socket at net.core.wmem_max).

    CPU: `cpu_time_s` is per process; the whole sandbox is stopped at `wall_time_s`, so together its
    processes use at most `wall_time_s` x the cores they can run on.
    """

    cpu_time_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL 1 s later."""

    wall_time_s: float = 10.0
    """Seconds from start until the trainer kills the whole sandbox (its process group and pid namespace)."""

    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), in MiB; with a memory cgroup also the whole sandbox's resident
    memory (plus `disk_mb`). Python itself needs about 30 MiB."""

    output_bytes: int = 65536
    """stdout and stderr are each kept up to this many bytes; a program writing more is stopped
    (status 'output_limit') and the kept prefix returned."""

    max_processes: int = 16
    """Processes and threads the program may have at once, itself included (RLIMIT_NPROC in its private
    user namespace, where the kernel counts per namespace and uid, and the pids cgroup where there is one;
    both leave room for the sandbox's own processes). With isolation='none' the program may not fork."""

    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), in MiB; also the size of its private /dev/shm."""

    disk_mb: int = 64
    """Size of the working directory, in MiB: a tmpfs private to the sandbox's mount namespace, so all the
    program's files together fit in it (writes past it fail with ENOSPC). With isolation='none' the working
    directory is on the trainer's disk and only `file_size_mb` (per file) applies."""

    isolation: IsolationMode = "namespaces"
    """'namespaces' (required by default): private user, pid, net, mount, ipc, uts and cgroup namespaces (no
    nested user namespaces), a read-only minimal root, the working directory on a size-limited tmpfs; a
    machine without unprivileged user namespaces makes every run raise `SandboxError` naming this setting.
    'none': rlimits, the seccomp filter and an audit hook only (no kernel boundary for files, network or other
    processes): only for code you would run anyway."""

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "wall_time_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a number of seconds > 0, got {value!r}")
        minimums = {"memory_mb": 32, "output_bytes": 1, "max_processes": 1, "file_size_mb": 1, "disk_mb": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SandboxLimits.{name} must be an int >= {minimum}, got {value!r}")
        if self.isolation not in ("namespaces", "none"):
            raise ValueError(f"SandboxLimits.isolation must be 'namespaces' or 'none', got {self.isolation!r}")

    @property
    def memory_bound_mb(self) -> int:
        """The most memory the whole sandbox can hold without a memory cgroup (see the class docstring)."""
        return self.memory_mb * self.max_processes + self.disk_mb + self.file_size_mb


@dataclass(frozen=True)
class HarnessVerdict:
    """What the test harness (a separate process the program cannot reach) found.

    passed: the test code ran to its end without an exception.
    started: the program ran to its end and answered the harness (False: it exited or failed first).
    detail: the first failure, e.g. 'AssertionError: ' or 'NameError: name 'f' is not defined'.
    """

    passed: bool
    started: bool
    detail: str = ""


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended.

    status:
        'ok'            exited with status 0
        'error'         exited non-zero (an uncaught exception prints its traceback to stderr, status 1)
        'timeout'       past `wall_time_s` (killed by the trainer) or `cpu_time_s` (SIGXCPU/SIGKILL)
        'memory'        died of MemoryError (past `memory_mb`), or the memory cgroup's OOM killer stopped it
        'output_limit'  wrote more than `output_bytes` to stdout or stderr; stopped, output truncated
        'killed'        died from a signal for another reason (segfault from deep recursion, abort, kill)
        'blocked'       attempted something the sandbox forbids (network, exec, writing outside its
                        directory, ctypes, ...); stopped at that point, the reason is on stderr's last line
    exit_code: the program's exit status; -N if a signal N ended it; None if the trainer stopped it.
    wall_s: seconds from start to end as seen by the trainer (waiting for a free slot not included).
    cpu_s: CPU seconds the program's main process used (None if the trainer stopped it).
    isolation: the layers that were active (e.g. 'net_ns', 'readonly_root', 'workdir_tmpfs', 'cgroup_memory',
        'audit_hook').
    isolation_mode: the `SandboxLimits.isolation` this run had: 'namespaces' or 'none'; 'remote'
        for a run on a SandboxFusion server (`hybridflow.sandbox.remote`).
    tests: the harness's verdict when the run was given `tests`, else None.
    """

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float | None = None
    isolation: tuple[str, ...] = ()
    isolation_mode: RunPlace = "none"
    tests: Optional[HarnessVerdict] = None

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 within every limit."""
        return self.status == "ok"
