"""verl's copies of other keys (its newer workers read them; its config derives them by interpolation): each must
agree with the key it copies, so that a line setting one of them means here what it means in verl."""

from __future__ import annotations

from typing import Any

from hybridflow.trainer.config.schema import PPOConfig

__all__ = ["check_verl_copies", "forward_only_error"]


def _copies(cfg: PPOConfig) -> list[tuple[str, Any, str, Any]]:
    """(copy key, its value, source key, the source's value) of every copy whose value is set."""
    arr = cfg.actor_rollout_ref
    rows = [
        ("actor_rollout_ref.actor.rollout_n", arr.actor.rollout_n, "actor_rollout_ref.rollout.n", arr.rollout.n),
        ("actor_rollout_ref.ref.rollout_n", arr.ref.rollout_n, "actor_rollout_ref.rollout.n", arr.rollout.n),
        ("critic.rollout_n", cfg.critic.rollout_n, "actor_rollout_ref.rollout.n", arr.rollout.n),
        ("actor_rollout_ref.actor.use_remove_padding", arr.actor.use_remove_padding,
         "actor_rollout_ref.model.use_remove_padding", arr.model.use_remove_padding),
        ("actor_rollout_ref.actor.use_fused_kernels", arr.actor.use_fused_kernels,
         "actor_rollout_ref.model.use_fused_kernels", arr.model.use_fused_kernels),
        ("reward_manager.name", cfg.reward_manager.name, "reward_model.reward_manager", cfg.reward_model.reward_manager),
        ("data.tool_config_path", cfg.data.tool_config_path, "actor_rollout_ref.rollout.multi_turn.tool_config_path",
         arr.rollout.multi_turn.tool_config_path),
    ]
    return [row for row in rows if row[1] is not None]


def check_verl_copies(cfg: PPOConfig) -> None:
    """ValueError naming the copy and its source when they differ; also each engine's `forward_only` against the
    role (actor and critic train, the reference does not) and the reference's router replay against the actor's."""
    for key, value, source, source_value in _copies(cfg):
        if value != source_value:
            raise ValueError(
                f"{key}={value!r} differs from {source}={source_value!r}: verl derives it from {source}, which is "
                f"the setting hybridflow reads; set {source}"
            )
    arr = cfg.actor_rollout_ref
    for key, forward_only, trains in (
        ("actor_rollout_ref.actor.fsdp_config.forward_only", arr.actor.fsdp_config.forward_only, True),
        ("critic.model.fsdp_config.forward_only", cfg.critic.model.fsdp_config.forward_only, True),
        ("actor_rollout_ref.ref.fsdp_config.forward_only", arr.ref.fsdp_config.forward_only, False),
    ):
        error = forward_only_error(key, forward_only, trains)
        if error is not None:
            raise ValueError(error)
    ref_mode, actor_mode = arr.ref.router_replay.mode, arr.actor.router_replay.mode
    if ref_mode != "disabled" and ref_mode != actor_mode:
        raise ValueError(
            f"actor_rollout_ref.ref.router_replay.mode={ref_mode!r} with actor_rollout_ref.actor.router_replay.mode="
            f"{actor_mode!r}: the reference replays the rollout's experts exactly when the actor does; set the "
            "actor's mode"
        )


def forward_only_error(key: str, forward_only: bool | None, trains: bool) -> str | None:
    """Why verl's `fsdp_config.forward_only` at `key` contradicts its role (None where it does not): the engine's
    role decides whether it trains."""
    if forward_only is None or forward_only != trains:
        return None
    return (f"{key}={forward_only}: that role {'trains' if trains else 'only runs forwards'} here (the engine's role "
            "decides it); leave it unset")
