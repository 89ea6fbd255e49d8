"""Save and resume a run: the workers' states plus the driver's own (step, data position, ...), for any trainer.

Layout: `{trainer.default_local_dir}/global_step_N/{<worker parts>, driver_state.json}`, staged and renamed
atomically by `checkpoint_dirs`, so an interrupted save never replaces the previous checkpoint. The driver
state is JSON (plain numbers): loading a checkpoint never unpickles anything the driver wrote.

On a Ray cluster the run directory must be one shared filesystem (e.g. NFS) mounted at the same path on every node:
ranks write their shards on their own nodes and the driver renames the staged step. `check_shared_dirs` proves it
(and that the resume checkpoint looks the same everywhere) before any training work; shards are never gathered
through the driver, which is not realistic at 7B-70B.
"""

from __future__ import annotations

import errno
import json
import logging
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.single_controller.base.worker import get_node_id, get_node_ip
from hybridflow.single_controller.ray import RayWorkerGroup
from hybridflow.trainer import checkpoint_dirs
from hybridflow.trainer.config.schema import RunConfig
from hybridflow.trainer.scaffold import WorkerProcesses
from hybridflow.utils import shared_path
from hybridflow.utils.shared_path import PathView

logger = logging.getLogger(__name__)

DRIVER_STATE = checkpoint_dirs.DRIVER_STATE
LEGACY_DRIVER_STATE = checkpoint_dirs.LEGACY_DRIVER_STATE


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
    path = checkpoint_dirs.resume_candidate(run.resume_mode, run.resume_from_path, root)
    if path is not None and not checkpoint_dirs.is_committed(path):
        raise FileNotFoundError(f"{path} holds no {DRIVER_STATE}: not a complete checkpoint")
    return path


def load_driver_state(path: Path) -> dict[str, Any]:
    """The driver state saved in checkpoint `path` (`global_steps` and whatever the trainer added)."""
    state = checkpoint_dirs.read_driver_state(path)
    if state is None:  # plain numbers only: the safe loader refuses anything else
        state = torch.load(path / LEGACY_DRIVER_STATE, weights_only=True)
    logger.info("resuming from %s at step %d", path, state["global_steps"])
    return state


def check_shared_dirs(
    run: RunConfig, root: Path, resume_dir: Path | None, processes: Sequence[WorkerProcesses]
) -> None:
    """Before training: every worker process of `processes` (the pools that save or load checkpoints) and the driver
    must see the same run directory `root` (a probe file each way) and the same files under `resume_dir`, else a
    ValueError names the key, the ranks and their nodes. Probes are removed again; checkpoints are only read.
    Workers in the driver's own process (local mode) see what it sees: nothing to check."""
    groups = [(process.name, process.group) for process in processes if isinstance(process.group, RayWorkerGroup)]
    if not groups:
        return
    token = secrets.token_hex(8)
    try:
        root.mkdir(parents=True, exist_ok=True)
        shared_path.write_probe(root, shared_path.probe_name(token, "driver"), token)
    except OSError as err:
        raise ValueError(
            f"trainer.default_local_dir={str(root)!r}: the driver cannot write there ({err}); point it to a "
            "writable directory on a filesystem that every node mounts at the same path"
        ) from err
    try:
        resume = None if resume_dir is None else str(resume_dir)
        views = {name: group.view_run_dir(str(root), token, resume) for name, group in groups}
        root_problems = _run_dir_problems(root, token, views)
        resume_problems = [] if resume_dir is None else _resume_dir_problems(resume_dir, views)
        for _, group in groups:  # files the driver cannot see (a node's own disk) only their writer removes
            group.remove_run_dir_probes(str(root), token)
    finally:
        shared_path.remove_probes(root, token)
    if root_problems or resume_problems:
        raise ValueError(_shared_dirs_message(run, root, resume_dir, root_problems, resume_problems))
    logger.info("%s is shared by the driver and all %d worker processes", root,
                sum(len(pool_views) for pool_views in views.values()))


def _run_dir_problems(root: Path, token: str, views: dict[str, list[PathView]]) -> list[str]:
    """One line per way a rank does not share `root` with the driver, in either direction."""
    problems = []
    for pool, pool_views in views.items():
        for view in pool_views:
            who = f"{view.describe()} of {pool}"
            if view.driver_probe_error is not None:
                problems.append(f"{who} cannot read the driver's probe: {view.driver_probe_error}")
            if view.write_error is not None:
                problems.append(f"{who} {view.write_error}")
            elif (error := shared_path.read_probe(root / view.probe_name, token)) is not None:
                problems.append(f"the driver cannot see the probe written by {who}: {error}")
    return problems


def _resume_dir_problems(resume_dir: Path, views: dict[str, list[PathView]]) -> list[str]:
    """One line per rank that sees other files under the resume checkpoint than the driver."""
    expected = shared_path.tree_fingerprint(resume_dir)
    return [
        f"{view.describe()} of {pool} sees "
        f"{'no such directory' if view.resume_fingerprint == 'missing' else 'other files there'} "
        f"(fingerprint {view.resume_fingerprint}, the driver's {expected})"
        for pool, pool_views in views.items() for view in pool_views if view.resume_fingerprint != expected
    ]


def _shared_dirs_message(
    run: RunConfig, root: Path, resume_dir: Path | None, root_problems: list[str], resume_problems: list[str]
) -> str:
    """The error of `check_shared_dirs`: the key, the path, one line per problem, the fix."""
    driver = f"the driver on node {get_node_id() or '?'} (ip {get_node_ip()})"
    lines = []
    if root_problems:
        lines.append(
            f"trainer.default_local_dir={str(root)!r} must be one directory that {driver} and every worker share: "
            "each rank writes its checkpoint shards there and the driver renames each staged step into place. "
            "Mount one shared filesystem (e.g. NFS) at that path on every node, or point trainer.default_local_dir "
            "at such a mount. Found:"
        )
        lines += [f"  - {line}" for line in root_problems]
    if resume_problems:
        key = "trainer.resume_from_path" if run.resume_mode == "resume_path" else "trainer.default_local_dir"
        lines.append(
            f"{key}: the checkpoint {resume_dir} that {driver} resumes from must hold the same files on every node "
            "(each rank loads its own shards from it); put it on the shared filesystem. Found:"
        )
        lines += [f"  - {line}" for line in resume_problems]
    return "\n".join(lines)
