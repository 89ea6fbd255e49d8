"""Before Ray: the checkpoint a run would resume from holds what each role's `checkpoint.load_contents` reads, was
saved with the settings that a resume restores rather than reads (`resumed_settings`), cut its shards for this run's
parallel layouts (`check_resumed_layouts`), and saved a data order this run's training rows can continue
(`check_resumed_data_order`, once the driver has built its data loader)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.trainer.checkpoint_dirs import read_driver_state, resume_candidate
from hybridflow.trainer.config.schema import PPOConfig, RunConfig
from hybridflow.workers.config import HF_MODEL_DIR, CheckpointConfig

__all__ = [
    "check_resume_contents", "check_resumed_data_order", "check_resumed_layouts", "check_resumed_settings", "resumed_checkpoint",
    "resumed_settings",
]

if TYPE_CHECKING:
    from hybridflow.engines.training.config import ParallelLayout

logger = logging.getLogger(__name__)


def resumed_checkpoint(run: RunConfig) -> Path | None:
    """The checkpoint `run` would resume from (`trainer.resume_mode`), read from the directories only, or None."""
    return resume_candidate(run.resume_mode, run.resume_from_path, run.local_dir().resolve())


def check_resume_contents(cfg: PPOConfig) -> None:
    """A checkpoint saved without a part that a role reads on resume (e.g. `save_contents=['hf_model']`, an
    export) is refused with what it holds and the ways on, instead of failing in the workers after Ray starts."""
    run = cfg.trainer
    path = resumed_checkpoint(run)
    if path is None:
        return
    check_resumed_settings(path, resumed_settings(cfg))
    from hybridflow.engines.training.engine_state import saved_parts  # torch: only when there is one to resume

    roles: list[tuple[str, str, CheckpointConfig]] = [
        ("actor", "actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.checkpoint)
    ]
    if cfg.critic_enabled:
        roles.append(("critic", "critic", cfg.critic.checkpoint))
    for role, section, checkpoint in roles:
        held = saved_parts(path / role)
        missing = [part for part in checkpoint.resume_parts if part not in held]
        if missing:
            export = path / role / HF_MODEL_DIR
            start_from = f"; its exported model is {export}" if export.is_dir() else ""
            raise ValueError(
                f"trainer.resume_mode={run.resume_mode!r} resumes from {path}, but its {role} holds "
                f"{sorted(held) or 'no training state'} and {section}.checkpoint.load_contents reads "
                f"{list(checkpoint.resume_parts)} (missing {missing}): set {section}.checkpoint.load_contents to "
                f"what it holds, or trainer.resume_mode=disable with another trainer.default_local_dir to start a "
                f"new run{start_from}"
            )


def resumed_settings(cfg: PPOConfig) -> dict[str, Any]:
    """The settings a resume takes from the checkpoint, not from the config: the actor's (and critic's) weights
    come from it whatever `model.path` says (while the reference model reads `model.path`), and the optimizer's and
    scheduler's state restore the saved learning rate. Saved in each checkpoint's driver state."""
    settings: dict[str, Any] = {
        "actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path,
        "actor_rollout_ref.actor.optim.lr": cfg.actor_rollout_ref.actor.optim.lr,
    }
    if cfg.critic_enabled:
        settings["critic.model.path"] = cfg.critic.model.path
        settings["critic.optim.lr"] = cfg.critic.optim.lr
    return settings


def check_resumed_settings(path: Path, now: dict[str, Any]) -> None:
    """Refuse a resume whose config changes a setting the checkpoint restores (it would be accepted and then
    ignored); a model path that no longer exists is taken as the same model moved, with a warning."""
    saved = (read_driver_state(path) or {}).get("settings", {})
    changed = []
    for key, value in now.items():
        if key not in saved or saved[key] == value:
            continue
        was = str(saved[key])
        if key.endswith("model.path") and ("/" in was or was.startswith("~")) and not Path(was).expanduser().exists():
            logger.warning("%s was %r when %s was saved; that path is gone, so %r is taken as the same model moved",
                           key, saved[key], path, value)
            continue
        changed.append(f"{key}: saved {saved[key]!r}, now {value!r}")
    if changed:
        raise ValueError(
            f"resuming from {path} would ignore what the config changed ({'; '.join(changed)}): the checkpoint "
            "restores the trained weights and the optimizer and scheduler state (its learning rate), while the "
            "reference model would read the new model path. Set them back to resume, or start a new run from this "
            "checkpoint's exported weights (trainer.resume_mode=disable, model.path=<its huggingface/ dir>)"
        )


def check_resumed_layouts(cfg: PPOConfig, layouts: dict[str, ParallelLayout]) -> None:
    """The actor's (and critic's) shards in the checkpoint a run would resume from were cut for the layout this run
    builds (`layouts`, by role, from `check_parallelism`): a changed number of ranks or sharding size is refused
    here, before Ray starts and the models load, with the engine's own rule (`ParallelLayout.shard_mismatch`)."""
    run = cfg.trainer
    path = resumed_checkpoint(run)
    if path is None:
        return
    import json

    from hybridflow.engines.training.engine_state import LAYOUT_FILE, RESUME_OTHER_LAYOUT  # torch: only here

    for role in ("actor", "critic"):
        record = path / role / LAYOUT_FILE
        if role not in layouts or not record.is_file():  # older checkpoints: the engine reads their shards' record
            continue
        try:
            saved = json.loads(record.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{record} cannot be read ({type(err).__name__}: {err}): the checkpoint is damaged; "
                             "resume from an earlier one with trainer.resume_from_path") from err
        mismatch = layouts[role].shard_mismatch(saved)
        if mismatch is not None:
            raise ValueError(
                f"trainer.resume_mode={run.resume_mode!r} resumes from {path}, whose {role} was written with "
                f"{mismatch}: {RESUME_OTHER_LAYOUT}"
            )


def check_resumed_data_order(run: RunConfig, sampler: Any) -> None:
    """The data order saved in the checkpoint a run would resume from continues on this run's sampler (the same
    number of training rows, seed and shuffle: `state_error`), checked once the driver has built its data loader
    and before Ray starts."""
    path = resumed_checkpoint(run)
    state = None if path is None else read_driver_state(path)
    if state is None or "sampler" not in state:
        return
    error = sampler.state_error(state["sampler"])
    if error is not None:
        raise ValueError(f"trainer.resume_mode={run.resume_mode!r} resumes from {path}: {error}")
