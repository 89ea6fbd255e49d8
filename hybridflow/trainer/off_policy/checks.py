"""What the off-policy trainers need from the config, checked before Ray starts (their commands call these)."""

from __future__ import annotations

from hybridflow.trainer.config import PPOConfig
from hybridflow.trainer.placement import is_split


def check_off_policy_trainer(cfg: PPOConfig, trainer: str, extra: list[tuple[bool, str, str]] = ()) -> None:
    """What an off-policy trainer (`trainer`, e.g. 'one-step off-policy') needs: split pools, one generation per
    step, batch generation; `extra` adds (refused, key, reason) rows."""
    if not is_split(cfg):
        raise ValueError(
            f"the {trainer} trainer generates on the rollout pool while the trainer pool trains: set "
            "actor_rollout_ref.hybrid_engine=False (and rollout.nnodes / rollout.n_gpus_per_node)"
        )
    refusals = [
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=True",
         "dynamic sampling draws a variable number of generation batches per step"),
        (cfg.estimator.greedy_baseline, f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}",
         "its greedy baseline (ReMax's) is a second generation of the same batch"),
        (cfg.actor_rollout_ref.rollout.mode == "async", "actor_rollout_ref.rollout.mode=async",
         "agent loops cannot yet be left running across a weight sync"),
        *extra,
    ]
    for refused, key, reason in refusals:
        if refused:
            raise ValueError(f"{key} is not supported by the {trainer} trainer: {reason}; use `hybridflow train`")


def check_one_step_off_policy(cfg: PPOConfig) -> None:
    """What the one-step off-policy trainer needs (`check_off_policy_trainer`)."""
    check_off_policy_trainer(cfg, "one-step off-policy")


def check_fully_async(cfg: PPOConfig) -> None:
    """What the fully async trainer needs: an off-policy trainer's (`check_off_policy_trainer`), a fixed sync
    schedule, and partial-rollout chunks shorter than a response."""
    check_off_policy_trainer(cfg, "fully async", [
        (cfg.trainer.critic_warmup > 0, f"trainer.critic_warmup={cfg.trainer.critic_warmup}",
         "the rollouter's staleness gate counts on a weight sync every trigger_parameter_sync_step steps; set it to 0"),
        (cfg.async_training.partial_rollout and cfg.actor_rollout_ref.rollout.over_sample_rate > 0,
         f"actor_rollout_ref.rollout.over_sample_rate={cfg.actor_rollout_ref.rollout.over_sample_rate} with "
         "async_training.partial_rollout=True",
         "over-sampling would end each chunk's call early and empty the rows that the next chunk continues; leave "
         "over_sample_rate at 0 or set partial_rollout=False"),
    ])
    async_cfg, length = cfg.async_training, cfg.actor_rollout_ref.rollout.response_length
    if async_cfg.partial_rollout and async_cfg.partial_rollout_chunk_tokens >= length:
        raise ValueError(
            f"async_training.partial_rollout_chunk_tokens={async_cfg.partial_rollout_chunk_tokens} is not below "
            f"actor_rollout_ref.rollout.response_length={length}: every response would be one call, which no sync "
            f"can pause; lower it (e.g. to {max(1, length // 4)}) or set async_training.partial_rollout=False"
        )
