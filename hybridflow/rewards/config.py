"""The reward sections of the RL trainer: `reward_model.*` (reward manager, scoring limits, DAPO's overlong
penalty) and `custom_reward_function.*` (a user scorer loaded from a file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridflow.rewards.manager.dapo import OverlongBufferConfig
from hybridflow.rewards.pool import ScoringConfig
from hybridflow.utils.config import unsupported

__all__ = ["CustomRewardFunctionConfig", "RewardModelConfig"]


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """How responses are scored by rules: a reward manager over per-`data_source` scorers (the learned reward
    model's settings are the worker's, `workers.config.RewardModelWorkerConfig`)."""

    reward_manager: str = "naive"
    """naive | batch | dapo, or a registered custom manager."""
    launch_reward_fn_async: bool = unsupported(False, "scoring runs in the driver's scorer pool between stages")
    """Score in the background while the next stage runs."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Where scorers run and how long one may take (a raising or hung scorer scores 0 and is counted)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong penalty (reward_manager=dapo)."""
    rule_reward_coef: float = 0.0
    """With a reward model (reward_model.enable): weight of the rule-based score (custom_reward_function or the
    data_source's scorer) added to the model's score; 0 uses the model's score alone, as verl does."""


@dataclass(frozen=True, kw_only=True)
class CustomRewardFunctionConfig:
    """A user scoring function loaded from a file."""

    path: Optional[str] = None
    """Python file defining the function (`~` is expanded); None uses the built-in scorers by data_source."""
    name: str = "compute_score"
    """Function name in that file."""
