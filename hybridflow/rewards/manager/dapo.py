"""The `dapo` reward manager: per-sample rule scores plus DAPO's soft overlong penalty.

DAPO (Yu et al. 2025, section 3.4, "overlong reward shaping"): with `L_max = max_resp_len` and a buffer
of `L_cache = overlong_buffer.len` tokens, a response of length `|y|` gets an extra reward of
`min(0, -(|y| - (L_max - L_cache)) / L_cache * penalty_factor)`: 0 up to `L_max - L_cache` tokens,
then falling linearly to `-penalty_factor` at `L_max`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.rewards.config import OverlongBufferConfig
from hybridflow.rewards.manager.base import (
    DecodedBatch, RewardManager, RewardResult, build_reward_result, check_error_fraction,
    log_examples)
from hybridflow.rewards.manager.naive import score_each
from hybridflow.rewards.pool import ScoringConfig
from hybridflow.sandbox.remote import SandboxFusionEndpoint

__all__ = ["DAPORewardManager", "OverlongBufferConfig", "compute_overlong_penalty"]


def compute_overlong_penalty(response_lengths: Sequence[int], max_resp_len: int, buffer_len: int,
                             penalty_factor: float) -> list[float]:
    """response_lengths: (bs,) valid tokens -> (bs,) penalties <= 0 (see the module docstring)."""
    expected_len = max_resp_len - buffer_len
    return [min(-(length - expected_len) / buffer_len * penalty_factor, 0.0) for length in response_lengths]


class DAPORewardManager(RewardManager):
    """`NaiveRewardManager` scoring plus the overlong penalty.

    Args: as `RewardManager`, plus
        max_resp_len: the rollout's maximum response length in tokens (needed when the buffer is enabled).
        overlong_buffer_cfg: `OverlongBufferConfig`; None disables the penalty.

    Raises:
        ValueError: the buffer is enabled without `max_resp_len`, or is not shorter than it.
    """

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Callable[..., Any] | None = None,
                 reward_fn_key: str = "data_source", *, max_resp_len: int | None = None,
                 overlong_buffer_cfg: OverlongBufferConfig | None = None, format_score: float = 0.0,
                 scoring: ScoringConfig = ScoringConfig(),
                 remote_sandbox: SandboxFusionEndpoint | None = None) -> None:
        self.overlong = overlong_buffer_cfg or OverlongBufferConfig()
        if self.overlong.enable:
            if max_resp_len is None:
                raise ValueError("reward_model.overlong_buffer.enable=True needs max_resp_len "
                                 "(set it to data.max_response_length)")
            self.overlong.check_len(max_resp_len)
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, format_score=format_score,
                         scoring=scoring, remote_sandbox=remote_sandbox)
        self.max_resp_len = max_resp_len

    @classmethod
    def from_config(cls, tokenizer: Any, compute_score: Callable[..., Any] | None, reward: Any, data: Any):
        """As `RewardManager.from_config`, with `reward.overlong_buffer` (its max_resp_len, or
        `data.max_response_length`)."""
        max_resp_len = reward.overlong_buffer.resolved_max_resp_len(data.max_response_length)
        return cls(tokenizer, 0, compute_score, data.reward_fn_key, max_resp_len=max_resp_len,
                   overlong_buffer_cfg=reward.overlong_buffer, scoring=reward.scoring,
                   remote_sandbox=reward.sandbox_fusion.endpoint())

    def score_decoded(self, data: DataProto, decoded: DecodedBatch) -> RewardResult:
        """The reward is score + penalty, while extra_info['score'] keeps the scorer's score."""
        scored = score_each(self.pool, decoded, self.compute_score, self.format_score, self.remote_sandbox)
        check_error_fraction(decoded, scored, self.pool.config.max_error_fraction)
        rewards = list(scored.scores)
        extra: dict[str, list[Any]] = {}
        if self.overlong.enable:
            penalties = compute_overlong_penalty(decoded.valid_response_lengths, self.max_resp_len,
                                                 self.overlong.len, self.overlong.penalty_factor)
            rewards = [r + p for r, p in zip(rewards, penalties)]
            if self.overlong.log:
                extra = {"overlong_reward": penalties, "overlong": [p < 0 for p in penalties]}
        log_examples(decoded, rewards, self.num_examine)
        return build_reward_result(data, decoded, scored, rewards, extra)
