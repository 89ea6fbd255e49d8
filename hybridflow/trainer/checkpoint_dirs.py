"""Checkpoint directories of a run: `global_step_N/`, written atomically, the latest one recorded, old ones pruned.

A step is written into `global_step_N.tmp-<pid>/` and renamed into place only when complete, then
`latest_checkpointed_iteration.txt` is replaced atomically. A kill during a save therefore leaves the
previous checkpoint and the pointer to it intact. Nothing is overwritten: saving a step that exists raises.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


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
    os.replace(staging, final)
    pointer = Path(root) / LATEST_FILE
    tmp_pointer = pointer.with_suffix(f".tmp-{os.getpid()}")
    tmp_pointer.write_text(str(step))
    os.replace(tmp_pointer, pointer)
    if max_to_keep is not None and max_to_keep > 0:
        for old in list_steps(root)[:-max_to_keep]:
            shutil.rmtree(step_dir(root, old))
            logger.info("removed old checkpoint %s (max_actor_ckpt_to_keep=%d)", step_dir(root, old), max_to_keep)
    return final


def list_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending (staging dirs are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(match.group(1)) for entry in root.iterdir() if (match := STEP_DIR.match(entry.name)))


def latest_step(root: str | os.PathLike) -> int | None:
    """The step recorded in `latest_checkpointed_iteration.txt`, if that checkpoint exists."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} holds {text!r}, not a step number; fix or delete it")
    step = int(text)
    if not step_dir(root, step).is_dir():
        raise FileNotFoundError(f"{pointer} points to step {step}, but {step_dir(root, step)} is missing")
    return step


def step_of(path: str | os.PathLike) -> int:
    """The step number of a `global_step_N` directory path."""
    match = STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a global_step_N checkpoint directory")
    return int(match.group(1))
