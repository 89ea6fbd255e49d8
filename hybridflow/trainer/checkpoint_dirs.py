"""Checkpoint directories of a run: `global_step_N/`, written atomically, the latest one recorded, old ones pruned.

A step is written into `global_step_N.tmp-<pid>/`, flushed to disk (fsync of every file and directory), and
renamed into place only when complete; then `latest_checkpointed_iteration.txt` (verl's pointer) is replaced
atomically. So every `global_step_N/` is complete, and the newest one is where a run resumes, even when a kill
came between the rename and the pointer update. A kill before the rename leaves a staging directory, removed by
the next run (`remove_stale_staging`). Nothing is overwritten: saving a step that exists raises.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
DRIVER_STATE = "driver_state.json"
LEGACY_DRIVER_STATE = "driver_state.pt"  # earlier versions; read with torch.load(weights_only=True)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Where step `step`'s checkpoint lives."""
    return Path(root) / f"global_step_{step}"


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    """Where step `step` is written before it is renamed into place (fresh, empty)."""
    staging = Path(root) / f"global_step_{step}.tmp-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit_step(root: str | os.PathLike, step: int, staging: Path, max_to_keep: int | None = None) -> Path:
    """Move a completely written `staging` dir to `global_step_{step}`, record it as latest, prune old steps."""
    final = step_dir(root, step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
    fsync_tree(staging)
    os.replace(staging, final)
    fsync_path(Path(root))
    pointer = Path(root) / LATEST_FILE
    tmp_pointer = pointer.with_suffix(f".tmp-{os.getpid()}")
    tmp_pointer.write_text(str(step))
    fsync_path(tmp_pointer)
    os.replace(tmp_pointer, pointer)
    fsync_path(Path(root))
    if max_to_keep is not None and max_to_keep > 0:
        for old in list_checkpoints(root)[:-max_to_keep]:
            shutil.rmtree(step_dir(root, old))
            logger.info("removed old checkpoint %s (max_actor_ckpt_to_keep=%d)", step_dir(root, old), max_to_keep)
    return final


def read_driver_state(path: str | os.PathLike) -> dict | None:
    """Checkpoint `path`'s `driver_state.json`, or None where it has none (a legacy `.pt` one, or none at all); a
    damaged file names itself and the way on."""
    state_file = Path(path) / DRIVER_STATE
    if not state_file.is_file():
        return None
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{state_file} is not valid JSON ({err}); the checkpoint is damaged: resume from an earlier "
                         "global_step_N (trainer.resume_mode=resume_path)") from err


def list_checkpoints(root: str | os.PathLike) -> list[int]:
    """Steps under `root` whose directory is a checkpoint hybridflow committed (it holds the driver state):
    the only ones pruning may delete, never a user's folder that happens to be named `global_step_N`."""
    return [step for step in list_steps(root) if is_committed(step_dir(root, step))]


def is_committed(path: str | os.PathLike) -> bool:
    """Whether `path` is a complete checkpoint: the driver state is written last, just before the commit."""
    return any((Path(path) / name).is_file() for name in (DRIVER_STATE, LEGACY_DRIVER_STATE))


def list_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending (staging dirs are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(match.group(1)) for entry in root.iterdir() if (match := STEP_DIR.match(entry.name)))


def latest_step(root: str | os.PathLike) -> int | None:
    """The newest complete checkpoint's step, or None. The pointer file is verl's record of the same; when it
    disagrees (a kill between a rename and the pointer update, or an edit) the directories win, with a warning:
    resuming from an older step would collide with the newer ones on its next save."""
    steps = list_steps(root)
    pointer = Path(root) / LATEST_FILE
    recorded = pointer.read_text().strip() if pointer.is_file() else None
    if steps and recorded != str(steps[-1]):
        logger.warning(
            "%s records %r but the newest checkpoint is global_step_%d; resuming from that (pick another with "
            "trainer.resume_mode=resume_path)", pointer, recorded, steps[-1],
        )
    return steps[-1] if steps else None


def remove_stale_staging(root: str | os.PathLike) -> list[Path]:
    """Delete what killed saves left (their process is gone): staging directories and half-written pointer
    files; returns what was removed."""
    root = Path(root)
    stems = ("global_step_", Path(LATEST_FILE).stem + ".tmp-")
    removed = []
    for entry in sorted(root.glob("*.tmp-*")) if root.is_dir() else []:
        pid = entry.name.rpartition(".tmp-")[2]
        if not entry.name.startswith(stems) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        if not _process_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
            logger.warning("removed %s, left by an interrupted save", entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a checkpoint is only committed once it is on disk)."""
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))


def step_of(path: str | os.PathLike) -> int:
    """The step number of a `global_step_N` directory path."""
    match = STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a global_step_N checkpoint directory")
    return int(match.group(1))


def resume_candidate(resume_mode: str, resume_from_path: str | None, root: str | os.PathLike) -> Path | None:
    """The checkpoint a run resumes from (trainer.resume_mode: disable, auto = the newest under `root`,
    resume_path = `resume_from_path`), or None; reads the directory only."""
    if resume_mode == "disable":
        return None
    if resume_mode == "resume_path":
        path = Path(str(resume_from_path)).expanduser().resolve()
        step_of(path)
        return path
    step = latest_step(root)
    return None if step is None else step_dir(root, step)
