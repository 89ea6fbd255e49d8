"""Save and resume a whole run: worker states plus the driver's own (step, data position, KL coefficient).

Layout: `{trainer.default_local_dir}/global_step_N/{actor,critic,driver_state.pt}`, staged and renamed
atomically by `checkpoint_dirs` so an interrupted save never replaces the previous checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hybridflow.trainer import checkpoint_dirs

logger = logging.getLogger(__name__)

DRIVER_STATE = "driver_state.pt"


def save(trainer: Any) -> Path:
    """Checkpoint step `trainer.global_steps`; returns its directory."""
    cfg = trainer.config.trainer
    root = Path(cfg.default_local_dir).resolve()  # workers may run in another directory
    staging = checkpoint_dirs.staging_dir(root, trainer.global_steps)
    contents = trainer.config.actor_rollout_ref.actor.checkpoint.save_contents
    hf_path = str(staging / "actor" / "huggingface_full") if "hf_model" in contents else None
    trainer.workers.actor_rollout.save_checkpoint(str(staging / "actor"), hf_path)
    if trainer.workers.critic is not None:
        trainer.workers.critic.save_checkpoint(str(staging / "critic"))
    state = {
        "global_steps": trainer.global_steps,
        "sampler": trainer.train_dataloader.sampler.state_dict(),
        "kl_coef": float(trainer.kl_ctrl.value),
    }
    torch.save(state, staging / DRIVER_STATE)
    final = checkpoint_dirs.commit_step(root, trainer.global_steps, staging, cfg.max_actor_ckpt_to_keep)
    logger.info("saved checkpoint %s", final)
    return final


def find_resume_dir(trainer: Any) -> Path | None:
    """The checkpoint to resume from per `trainer.resume_mode`, or None to start fresh."""
    cfg = trainer.config.trainer
    if cfg.resume_mode == "disable":
        return None
    if cfg.resume_mode == "resume_path":
        path = Path(cfg.resume_from_path).resolve()
        checkpoint_dirs.step_of(path)
        if not (path / DRIVER_STATE).is_file():
            raise FileNotFoundError(f"trainer.resume_from_path={path} holds no {DRIVER_STATE}: not a complete checkpoint")
        return path
    root = Path(cfg.default_local_dir).resolve()
    step = checkpoint_dirs.latest_step(root)
    return None if step is None else checkpoint_dirs.step_dir(root, step)


def maybe_resume(trainer: Any) -> int:
    """Load the checkpoint chosen by `find_resume_dir` into workers and driver; return the step to continue from."""
    path = find_resume_dir(trainer)
    if path is None:
        return 0
    state = torch.load(path / DRIVER_STATE, weights_only=False)
    trainer.workers.actor_rollout.load_checkpoint(str(path / "actor"))
    if trainer.workers.critic is not None:
        trainer.workers.critic.load_checkpoint(str(path / "critic"))
    trainer.train_dataloader.sampler.load_state_dict(state["sampler"])
    trainer.kl_ctrl.value = state["kl_coef"]
    logger.info("resumed from %s at step %d", path, state["global_steps"])
    return int(state["global_steps"])
