"""The reward-manager registry (`reward_model.reward_manager`), importable without torch.

The built-in managers register lazily (their modules, which import torch, load on first `get`), so the config
checks before Ray read the names at once. A user's manager registers with `@REWARD_MANAGERS.register("name")`.
"""

from __future__ import annotations

from hybridflow.utils.registry import Registry

REWARD_MANAGERS: Registry[type] = Registry("reward manager")

for _name, _target in (
    ("naive", "hybridflow.rewards.manager.naive:NaiveRewardManager"),
    ("batch", "hybridflow.rewards.manager.batch:BatchRewardManager"),
    ("dapo", "hybridflow.rewards.manager.dapo:DAPORewardManager"),
    # verl's `prime` manager is per-sample rule scoring in a process pool with a per-call timeout (a failed or
    # timed-out call scores 0): what `naive` does here, through the scorer pool (`rewards/pool.py`).
    ("prime", "hybridflow.rewards.manager.naive:NaiveRewardManager"),
):
    REWARD_MANAGERS.register_lazy(_name, _target)
