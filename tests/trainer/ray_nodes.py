"""Ray clusters started by the tests: a private RAY_TMPDIR for clusters that must not be found by other
`ray.init()` calls on this machine, and `ray start --block` nodes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


@pytest.fixture()
def ray_tmpdir(monkeypatch) -> Iterator[Path]:
    """A private Ray temp dir (short: Ray's socket paths must stay under 108 bytes) and the environment that the
    clusters and the trainer share: no token auth, this checkout on the workers' path."""
    path = Path(tempfile.mkdtemp(prefix="hf-ray-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_ray(log: Path, *args: str) -> subprocess.Popen:
    """`ray start ... --block` (terminating it tears the node down), once the node has registered."""
    ray_cli = Path(sys.executable).with_name("ray")
    command = [str(ray_cli), "start", "--block", "--num-cpus=1", *args]
    return start_node(command, log, f"ray start {' '.join(args)}")


def start_node(command: list[str], log: Path, what: str) -> subprocess.Popen:
    """`command` (one that ends in `ray start --block`), its output in `log`, once Ray says the node started;
    a `RuntimeError` naming `what` with the log's end if it exits or takes over 60 s."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out)
    deadline = time.monotonic() + 60
    while "Ray runtime started" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.terminate()
            raise RuntimeError(f"{what} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return process


def stop_ray(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
