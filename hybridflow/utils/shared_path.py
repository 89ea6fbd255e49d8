"""Probing whether processes on several nodes see one directory: the pure file operations behind the driver's
start-up check that `trainer.default_local_dir` (and the checkpoint a run resumes from) is shared.

Checkpoints assume a shared filesystem: each rank writes its shards into a staging directory that the driver
then renames, so a directory that only some nodes see loses shards silently. The driver writes a probe file holding
a random token into the run directory; every worker process reads it back (`view_run_dir`) and writes a probe of
its own that the driver reads back; everything is removed afterwards (`remove_probes`). Probe files are new,
hidden, uniquely named files created exclusively: they never touch or replace a checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

PROBE_PREFIX = ".hybridflow-shared-dir-probe-"
"""Probe files are `{root}/{PROBE_PREFIX}{token}.{writer}`; `checkpoint_dirs` never matches them."""

SMALL_FILE_BYTES = 64 * 1024
"""Files up to this size count with their contents in `tree_fingerprint` (driver state, pointers, configs)."""


@dataclass(frozen=True)
class PathView:
    """What one worker process sees of the driver's run directory (and the checkpoint the run resumes from)."""

    rank: int
    node_ip: str
    node_id: str
    """Ray node id (hex); "" outside Ray."""
    pid: int
    driver_probe_error: str | None
    """Why the driver's probe could not be read back, or None when it held the driver's token."""
    probe_name: str | None
    """The probe this process wrote into the run directory, or None when it could not (`write_error`)."""
    write_error: str | None
    resume_fingerprint: str | None
    """`tree_fingerprint` of the resume checkpoint, or None when the run starts fresh."""

    def describe(self) -> str:
        """`rank R on node N (ip I, pid P)`, as error messages name a rank."""
        return f"rank {self.rank} on node {self.node_id or '?'} (ip {self.node_ip}, pid {self.pid})"


def probe_name(token: str, writer: str) -> str:
    """The file name of `writer`'s probe for check `token` (`writer` is "driver" or a worker's node and pid)."""
    return f"{PROBE_PREFIX}{token}.{writer}"


def write_probe(directory: Path, name: str, token: str) -> Path:
    """Create `directory/name` holding `token`; raises FileExistsError rather than replace any file."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as file:
        file.write(token)
    return path


def read_probe(path: Path, token: str) -> str | None:
    """None when `path` holds `token`, else why not (missing, another token, an OS error), for an error message."""
    try:
        found = path.read_text()
    except FileNotFoundError:
        return f"{path} does not exist there"
    except OSError as err:
        return f"{path} cannot be read: {err}"
    if found != token:
        return f"{path} holds another token ({found[:40]!r}): a different file at the same path"
    return None


def tree_fingerprint(path: Path) -> str:
    """A digest of the files under `path`: relative names and sizes, and the contents of small files; "missing"
    when `path` is not a directory. Two processes that see the same checkpoint get the same digest."""
    if not path.is_dir():
        return "missing"
    digest = hashlib.sha256()
    for directory, subdirs, files in os.walk(path):
        subdirs.sort()
        for name in sorted(files):
            file = Path(directory) / name
            size = file.stat().st_size
            digest.update(f"{file.relative_to(path)}\0{size}\0".encode())
            if size <= SMALL_FILE_BYTES:
                digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def view_run_dir(
    root: Path, token: str, resume_dir: Path | None, *, rank: int, node_ip: str, node_id: str
) -> PathView:
    """A worker's side of the check: read the driver's probe in `root`, fingerprint `resume_dir`, and write a probe
    of its own (last, so that nothing can fail after it exists). Failures are reported, not raised: the driver
    names every rank that does not share the directory in one error."""
    driver_probe_error = read_probe(root / probe_name(token, "driver"), token)
    fingerprint = None if resume_dir is None else tree_fingerprint(resume_dir)
    name, write_error = probe_name(token, f"{node_id[:16] or node_ip}-{os.getpid()}"), None
    try:
        write_probe(root, name, token)
    except OSError as err:
        name, write_error = None, f"cannot create a file in {root}: {err}"
    return PathView(rank, node_ip, node_id, os.getpid(), driver_probe_error, name, write_error, fingerprint)


def remove_probes(root: Path, token: str) -> list[Path]:
    """Delete every probe of check `token` that this process sees in `root` (other processes may delete the same
    files at once on a shared directory); returns what this call removed."""
    removed = []
    for path in root.glob(f"{PROBE_PREFIX}{token}.*") if root.is_dir() else []:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
