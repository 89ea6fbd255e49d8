"""Rewards: rule scorers dispatched on `data_source`, reward managers, custom reward functions from files.

The trainer builds a manager with `get_reward_manager_cls(name).from_config(tokenizer, compute_score, reward, data)`
and calls `manager(batch)`, which returns a `RewardResult`: `reward_tensor` (bs, response_len) with each
sample's reward on its last valid token, per-sample `extra_info` columns and batch `metrics`.
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config sections in this
# package import without torch).
_EXPORTS = {
    "FileRewardFunction": "custom",
    "load_custom_reward_fn": "custom",
    "REWARD_MANAGERS": "manager",
    "BatchRewardManager": "manager",
    "DAPORewardManager": "manager",
    "NaiveRewardManager": "manager",
    "OverlongBufferConfig": "manager",
    "RewardManager": "manager",
    "RewardResult": "manager",
    "compute_overlong_penalty": "manager",
    "get_reward_manager_cls": "manager",
    "ScoreOutcome": "pool",
    "ScorerPool": "pool",
    "ScoringConfig": "pool",
    "SCORERS": "score",
    "default_compute_score": "score",
    "default_compute_score_batched": "score",
    "resolve_scorer": "score",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
