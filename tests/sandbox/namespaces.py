"""What the sandbox tests share: whether this machine gives the sandbox user namespaces (a test that needs them
fails unless HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1 declares it cannot), and the live processes left in a directory."""

from __future__ import annotations

import os
import time

import pytest

from hybridflow.env import sandbox_namespaces_unavailable
from hybridflow.sandbox import SandboxError, run_python


_NAMESPACES: list[bool] = []


NO_NAMESPACES = ("unprivileged user namespaces are unavailable on this machine (`unshare -Ur true` fails), so "
                 "the sandbox's default isolation cannot be tested here")


def namespaces_work() -> bool:
    if not _NAMESPACES:
        try:
            _NAMESPACES.append("user_ns" in run_python("").isolation)
        except SandboxError:
            _NAMESPACES.append(False)
    return _NAMESPACES[0]


def require_namespaces() -> None:
    """Fail the calling test where the sandbox gets no namespaces, unless the machine is declared unable to
    give them (HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1): a suite that skipped here stayed green untested."""
    if namespaces_work():
        return
    if sandbox_namespaces_unavailable():
        pytest.skip(f"SKIPPED (HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1): {NO_NAMESPACES}")
    pytest.fail(f"{NO_NAMESPACES}; set HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1 to skip these tests on such a machine")


def processes_in(root, wait_s: float = 3.0) -> list[int]:
    """Live (not zombie) processes whose command line or cwd lies in `root`: a sandbox's P0, R, program or
    children. SIGKILLed processes take a moment to be torn down and reaped, so this waits up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    cmdline = handle.read()
                cwd = os.readlink(f"/proc/{entry}/cwd")
                with open(f"/proc/{entry}/stat") as handle:
                    state = handle.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in "ZX" and (str(root).encode() in cmdline or cwd.startswith(str(root))):
                found.append(int(entry))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
