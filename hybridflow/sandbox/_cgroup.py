"""A memory cgroup per sandbox, where the kernel lets the trainer make one: the whole sandbox's memory cap.

The trainer creates `hybridflow-sandbox-<random>` (see below where), sets the memory limit and (v2) the
process limit, and passes the directory to `_child.py`, whose first act (before any namespace, before the
program exists) is to move itself into it; every process of the sandbox then starts inside. After the run
the trainer reads the OOM-kill count (status 'memory'), kills what is left (v2 `cgroup.kill`) and removes it.

Which hierarchy: cgroup v2 when the trainer's own cgroup, or its parent (a systemd delegated user slice),
enables the memory controller for its children and is writable by the trainer (the sandbox's cgroup goes
below it, or beside the trainer's); else a cgroup v1 memory hierarchy mounted writable (a root trainer on a
v1 or hybrid host). Nothing of the host's cgroup configuration is changed. Otherwise there is no cgroup and the
sandbox's memory is bounded by rlimits only (`SandboxLimits.memory_bound_mb`); one warning says so.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

__all__ = ["Cgroup", "create_cgroup", "describe_cgroup_support"]

logger = logging.getLogger(__name__)

PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_SELF_MOUNTINFO = "/proc/self/mountinfo"
_REMOVE_WAIT_S = 2.0


@dataclass(frozen=True)
class _Parent:
    path: str
    version: int


class _Support:
    """Where this process creates sandbox cgroups: found on first use; None after a failure (logged once)."""

    lock = threading.Lock()
    checked = False
    parent: _Parent | None = None
    reason = ""


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(root, mount point, fstype, super options) of every mount, from mountinfo."""
    found = []
    for line in _read(PROC_SELF_MOUNTINFO).splitlines():
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        found.append((fields[3], fields[4].replace("\\040", " "), fields[sep + 1], fields[sep + 3].split(",")))
    return found


def _own_cgroups() -> dict[str, str]:
    """controller ('' for v2, 'memory' for a v1 memory hierarchy) -> this process's cgroup path."""
    paths = {}
    for line in _read(PROC_SELF_CGROUP).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _join(mount_root: str, mount_point: str, path: str) -> str | None:
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None  # our cgroup is outside what this mount shows
    relative = path[len(mount_root):] if mount_root != "/" else path
    return mount_point.rstrip("/") + relative.rstrip("/") if relative != "/" else mount_point


def _find_parent() -> tuple[_Parent | None, str]:
    """The directory under which sandbox cgroups go, or (None, why not)."""
    own, reasons = _own_cgroups(), []
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup2" and "" in own:
            directory = _join(root, point, own[""])
            if directory is None or not os.path.isfile(os.path.join(directory, "cgroup.controllers")):
                continue
            for candidate in (directory, os.path.dirname(directory)):  # below our cgroup, else beside it
                if not os.path.isfile(os.path.join(candidate, "cgroup.subtree_control")):
                    continue
                if "memory" not in _read(os.path.join(candidate, "cgroup.subtree_control")).split():
                    reasons.append(f"cgroup v2 {candidate} does not enable the memory controller for its children")
                elif not os.access(candidate, os.W_OK):
                    reasons.append(f"cgroup v2 {candidate} is not writable")
                else:
                    return _Parent(candidate, 2), ""
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup" and "memory" in options and "memory" in own:
            directory = _join(root, point, own["memory"])
            if directory is not None and os.path.isfile(os.path.join(directory, "memory.limit_in_bytes")):
                if os.access(directory, os.W_OK):  # False on a read-only mount too
                    return _Parent(directory, 1), ""
                reasons.append(f"cgroup v1 memory {directory} is not writable")
    return None, "; ".join(reasons) or "no cgroup memory controller is mounted"


@dataclass
class Cgroup:
    """One sandbox's cgroup directory."""

    path: str
    version: int

    @property
    def layer(self) -> str:
        return "cgroup_memory"

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer stopped in this cgroup (0 if unknown)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.path, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass  # the count is a refinement of the status; the run's outcome stands without it
        return 0

    def remove(self) -> None:
        """Kill what is left in it (v2), then remove it; the last processes may take a moment to be released."""
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                _write(os.path.join(self.path, "cgroup.kill"), "1")
            except OSError as err:
                logger.warning("sandbox: could not kill the processes of %s: %s", self.path, err)
        deadline = time.monotonic() + _REMOVE_WAIT_S
        delay = 0.001
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY or time.monotonic() > deadline:
                    logger.warning("sandbox: could not remove cgroup %s: %s", self.path, err)
                    return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _configure(path: str, version: int, memory_bytes: int, max_processes: int) -> None:
    if version == 2:
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "0"), ("pids.max", str(max_processes))):
            if os.path.exists(os.path.join(path, name)):
                _write(os.path.join(path, name), value)
    else:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):  # no swapping past the cap
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))


def create_cgroup(memory_bytes: int, max_processes: int) -> Cgroup | None:
    """A fresh cgroup capped at `memory_bytes` (and, v2, `max_processes` tasks), or None where the kernel
    gives this process no writable memory cgroup (warned once)."""
    with _Support.lock:
        if not _Support.checked:
            _Support.checked = True
            try:
                _Support.parent, _Support.reason = _find_parent()
            except (OSError, ValueError) as err:  # unreadable or unexpected /proc/self/{cgroup,mountinfo}
                _Support.parent, _Support.reason = None, f"cannot read the cgroup mounts: {err}"
            if _Support.parent is None:
                logger.warning("sandbox: no writable memory cgroup (%s); each sandboxed process's address space is "
                               "capped (RLIMIT_AS), the whole sandbox only at memory_mb x max_processes + disk_mb "
                               "+ file_size_mb", _Support.reason)
        parent = _Support.parent
    if parent is None:
        return None
    path = os.path.join(parent.path, f"hybridflow-sandbox-{secrets.token_hex(6)}")
    try:
        os.mkdir(path)
    except OSError as err:
        _disable(f"cannot create {path}: {err}")
        return None
    cgroup = Cgroup(path, parent.version)
    try:
        _configure(path, parent.version, memory_bytes, max_processes + 2)  # + P0 and R, as RLIMIT_NPROC in _child
    except OSError as err:
        cgroup.remove()
        _disable(f"cannot set limits in {path}: {err}")
        return None
    return cgroup


def _disable(reason: str) -> None:
    with _Support.lock:
        if _Support.parent is not None:
            logger.warning("sandbox: memory cgroups disabled for this process (%s); the whole sandbox's memory is "
                           "bounded by rlimits only from now on", reason)
        _Support.parent, _Support.reason = None, reason


def describe_cgroup_support() -> str:
    """'cgroup v1 at DIR', 'cgroup v2 at DIR', or 'none (why)', for `hybridflow doctor`."""
    with _Support.lock:
        if not _Support.checked:
            try:
                parent, reason = _find_parent()
            except (OSError, ValueError) as err:
                parent, reason = None, str(err)
        else:
            parent, reason = _Support.parent, _Support.reason
    return f"cgroup v{parent.version} at {parent.path}" if parent else f"none ({reason})"


def reset_for_tests() -> None:
    """Forget what was found (tests point the module at a fake cgroup tree)."""
    with _Support.lock:
        _Support.checked, _Support.parent, _Support.reason = False, None, ""
