"""What a sandboxed run may use (`SandboxLimits`) and how it ended (`SandboxResult`, `SandboxError`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "SandboxStatus"]

SandboxStatus = Literal["ok", "error", "timeout", "memory", "output_limit", "killed", "blocked"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (the interpreter could not start, or isolation could not be set up); the
    program did not run. A program's own failures are results, never this exception."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resources one run may use. Every limit applies to the program and each process it forks."""

    cpu_time_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL 1 s later."""

    wall_time_s: float = 10.0
    """Seconds from start until the trainer kills the whole sandbox (its process group and pid namespace)."""

    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), in MiB. Python itself needs about 30 MiB."""

    output_bytes: int = 65536
    """stdout and stderr are each kept up to this many bytes; a program writing more is stopped
    (status 'output_limit') and the kept prefix returned."""

    max_processes: int = 16
    """Processes and threads the program may have at once, itself included (RLIMIT_NPROC in its private
    user namespace; the kernel counts per namespace and uid). Without namespaces the program may not fork."""

    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), in MiB; also the size of its private /dev/shm."""

    use_namespaces: bool = True
    """Isolate with Linux namespaces where the kernel allows it (the default; one warning is logged where it
    does not). False runs with rlimits and the audit hook only, the fallback mode: for tests and debugging."""

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "wall_time_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a number of seconds > 0, got {value!r}")
        minimums = {"memory_mb": 32, "output_bytes": 1, "max_processes": 1, "file_size_mb": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SandboxLimits.{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.use_namespaces, bool):
            raise ValueError(f"SandboxLimits.use_namespaces must be a bool, got {self.use_namespaces!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended.

    status:
        'ok'            exited with status 0
        'error'         exited non-zero (an uncaught exception prints its traceback to stderr, status 1)
        'timeout'       past `wall_time_s` (killed by the trainer) or `cpu_time_s` (SIGXCPU/SIGKILL)
        'memory'        died of MemoryError (past `memory_mb`)
        'output_limit'  wrote more than `output_bytes` to stdout or stderr; stopped, output truncated
        'killed'        died from a signal for another reason (segfault from deep recursion, abort, kill)
        'blocked'       attempted something the sandbox forbids (network, exec, writing outside its
                        directory, ctypes, ...); stopped at that point, the reason is on stderr's last line
    exit_code: the program's exit status; -N if a signal N ended it; None if the trainer stopped it.
    wall_s: seconds from start to end as seen by the trainer.
    cpu_s: CPU seconds the program's main process used (None if the trainer stopped it).
    isolation: the isolation layers that were active (e.g. 'net_ns', 'readonly_root', 'audit_hook').
    """

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float | None = None
    isolation: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 within every limit."""
        return self.status == "ok"
