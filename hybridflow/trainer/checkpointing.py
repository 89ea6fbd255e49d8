"""Save and resume a run: the workers' states plus the driver's own (step, data position, ...), for any trainer.

Layout: `{trainer.default_local_dir}/global_step_N/{<worker parts>, driver_state.json}`, staged and renamed
atomically by `checkpoint_dirs`, so an interrupted save never replaces the previous checkpoint. The driver
state is JSON (plain numbers): loading a checkpoint never unpickles anything the driver wrote.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.config import expand_path
from hybridflow.trainer import checkpoint_dirs
from hybridflow.trainer.config.schema import RunConfig

logger = logging.getLogger(__name__)

DRIVER_STATE = "driver_state.json"
LEGACY_DRIVER_STATE = "driver_state.pt"  # earlier versions; read with torch.load(weights_only=True)


def save_checkpoint(
    root: Path, step: int, save_workers: Callable[[Path], None], driver_state: dict[str, Any],
    max_to_keep: int | None,
) -> Path:
    """Write step `step` under `root`: `save_workers(staging_dir)` then the driver state, then commit atomically
    (older steps beyond `max_to_keep` are deleted); returns the checkpoint directory."""
    staging = checkpoint_dirs.staging_dir(root, step)
    try:
        save_workers(staging)
        (staging / DRIVER_STATE).write_text(json.dumps({"global_steps": step, **driver_state}))
        final = checkpoint_dirs.commit_step(root, step, staging, max_to_keep)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        if err.errno == errno.ENOSPC:
            latest = checkpoint_dirs.latest_step(root)
            raise OSError(
                errno.ENOSPC,
                f"no space left on the device of {root} while saving step {step}; the partial save was removed and "
                f"the previous checkpoint ({'global_step_%d' % latest if latest is not None else 'none'}) is "
                "intact. Free space (every kept checkpoint plus one more must fit) or lower max_*ckpt_to_keep",
            ) from err
        raise
    logger.info("saved checkpoint %s", final)
    return final


def find_resume_dir(run: RunConfig, root: Path) -> Path | None:
    """The checkpoint to resume from per `trainer.resume_mode` (newest under `root` for auto), or None; staging
    directories of killed saves are removed first."""
    checkpoint_dirs.remove_stale_staging(root)
    if run.resume_mode == "disable":
        return None
    if run.resume_mode == "resume_path":
        path = expand_path(run.resume_from_path).resolve()
        checkpoint_dirs.step_of(path)
    else:
        step = checkpoint_dirs.latest_step(root)
        if step is None:
            return None
        path = checkpoint_dirs.step_dir(root, step)
    if not (path / DRIVER_STATE).is_file() and not (path / LEGACY_DRIVER_STATE).is_file():
        raise FileNotFoundError(f"{path} holds no {DRIVER_STATE}: not a complete checkpoint")
    return path


def load_driver_state(path: Path) -> dict[str, Any]:
    """The driver state saved in checkpoint `path` (`global_steps` and whatever the trainer added)."""
    if (path / DRIVER_STATE).is_file():
        state = json.loads((path / DRIVER_STATE).read_text())
    else:  # plain numbers only: the safe loader refuses anything else
        state = torch.load(path / LEGACY_DRIVER_STATE, weights_only=True)
    logger.info("resuming from %s at step %d", path, state["global_steps"])
    return state
