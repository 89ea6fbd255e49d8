"""Before Ray: the checkpoint a run would resume from holds what each role's `checkpoint.load_contents` reads."""

from __future__ import annotations

from hybridflow.trainer.checkpoint_dirs import resume_candidate
from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.workers.config import HF_MODEL_DIR, CheckpointConfig

__all__ = ["check_resume_contents"]


def check_resume_contents(cfg: PPOConfig) -> None:
    """A checkpoint saved without a part that a role reads on resume (e.g. `save_contents=['hf_model']`, an
    export) is refused with what it holds and the ways on, instead of failing in the workers after Ray starts."""
    run = cfg.trainer
    path = resume_candidate(run.resume_mode, run.resume_from_path, run.local_dir().resolve())
    if path is None:
        return
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
