"""verl's `model.use_shm`: a checkpoint copied to shared memory (`/dev/shm`) once per node, and loaded from there by
every worker of the node (RAM-speed reads instead of a slow or network disk)."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

SHM_ROOT = Path("/dev/shm/hybridflow_models")
"""Where the copies live (one per checkpoint and version of its files)."""


def shm_copy_of(location: str | os.PathLike, root: Path = SHM_ROOT) -> str:
    """The copy in shared memory of a model directory or `.gguf` file (made now if missing; concurrent callers
    race safely: each copies to its own temporary name and the first rename wins). The copy's name follows the
    source's path, file sizes and modification times, so a changed checkpoint is copied again. RuntimeError when
    shared memory is missing or too small for it."""
    source = Path(location).expanduser().resolve()
    files = sorted(source.rglob("*")) if source.is_dir() else [source]
    files = [path for path in files if path.is_file()]
    signature = hashlib.sha1(str(source).encode())
    for path in files:
        stat = path.stat()
        signature.update(f"{path.relative_to(source) if source.is_dir() else path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = root / signature.hexdigest()[:16] / source.name
    if target.exists():
        return str(target)
    if not root.parent.is_dir():
        raise RuntimeError(f"model.use_shm=True: {root.parent} does not exist on this node; set use_shm=False")
    size = sum(path.stat().st_size for path in files)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if size > free:
        raise RuntimeError(
            f"model.use_shm=True: {source} takes {size / 2**30:.2f} GiB and {root.parent} has {free / 2**30:.2f} GiB "
            "free; free shared memory or set use_shm=False"
        )
    staging = target.parent / f".{source.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # each caller its own
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        if source.is_dir():
            shutil.copytree(source, staging)
        else:
            shutil.copy2(source, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.exists():  # not another process's finished copy: a real failure
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging) if staging.is_dir() else staging.unlink()
    return str(target)
