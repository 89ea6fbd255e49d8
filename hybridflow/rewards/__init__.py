"""Rewards: rule scorers dispatched on `data_source`, reward managers, custom reward functions from files.

The trainer builds a manager with `get_reward_manager_cls(name).from_config(tokenizer, compute_score, reward, data)`
and calls `manager(batch)`, which returns a `RewardResult`: `reward_tensor` (bs, response_len) with each
sample's reward on its last valid token, per-sample `extra_info` columns and batch `metrics`.
"""

from hybridflow.rewards.custom import FileRewardFunction, load_custom_reward_fn
from hybridflow.rewards.manager import (
    REWARD_MANAGERS, BatchRewardManager, DAPORewardManager, NaiveRewardManager, OverlongBufferConfig, RewardResult,
    compute_overlong_penalty, get_reward_manager_cls)
from hybridflow.rewards.pool import ScoreOutcome, ScorerPool, ScoringConfig
from hybridflow.rewards.score import SCORERS, default_compute_score, default_compute_score_batched, resolve_scorer

__all__ = [
    "REWARD_MANAGERS",
    "SCORERS",
    "BatchRewardManager",
    "DAPORewardManager",
    "FileRewardFunction",
    "NaiveRewardManager",
    "OverlongBufferConfig",
    "RewardResult",
    "ScoreOutcome",
    "ScorerPool",
    "ScoringConfig",
    "compute_overlong_penalty",
    "default_compute_score",
    "default_compute_score_batched",
    "get_reward_manager_cls",
    "load_custom_reward_fn",
    "resolve_scorer",
]
