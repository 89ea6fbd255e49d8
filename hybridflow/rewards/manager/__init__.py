"""Reward managers (`naive`, `batch`, `dapo`): a generated `DataProto` in, a `RewardResult` out."""

from __future__ import annotations

from hybridflow.rewards.manager.base import REWARD_MANAGERS, RewardManager, RewardResult, get_reward_manager_cls
from hybridflow.rewards.manager.batch import BatchRewardManager
from hybridflow.rewards.manager.dapo import DAPORewardManager, OverlongBufferConfig, compute_overlong_penalty
from hybridflow.rewards.manager.naive import NaiveRewardManager

__all__ = [
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "OverlongBufferConfig",
    "RewardManager",
    "RewardResult",
    "compute_overlong_penalty",
    "get_reward_manager_cls",
]
