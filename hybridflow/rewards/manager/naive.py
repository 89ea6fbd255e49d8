"""The `naive` reward manager: score each response on its own with the rule scorer of its data source."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import (
    REWARD_MANAGERS, RewardResult, bind_scorers, build_reward_result, check_error_fraction, decode_batch,
    log_examples, precomputed_reward, unpack_outcomes)
from hybridflow.rewards.pool import ScorerPool, ScoringConfig

__all__ = ["NaiveRewardManager", "score_each"]


def score_each(pool: ScorerPool, decoded: Any, compute_score: Callable[..., Any] | None, format_score: float) -> Any:
    """Run one scorer call per sample through `pool`; returns a `ScoredBatch`."""
    scorers = bind_scorers(compute_score, decoded.data_sources, format_score, pool.config.sandbox)
    calls = [
        (scorers[ds], {"data_source": ds, "solution_str": sol, "ground_truth": gt, "extra_info": info})
        for ds, sol, gt, info in zip(decoded.data_sources, decoded.response_strs, decoded.ground_truths,
                                     decoded.extra_infos)
    ]
    return unpack_outcomes(pool.run(calls))


@REWARD_MANAGERS.register("naive")
class NaiveRewardManager:
    """Rule-based rewards, one scorer call per sample, in worker processes with a timeout.

    Args:
        tokenizer: decodes the response tokens.
        num_examine: samples per data source to log at INFO on each call.
        compute_score: a custom `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`
            (e.g. from `load_custom_reward_fn`); None uses the scorer registered for each data source.
        reward_fn_key: the non-tensor column naming the data source.
        format_score: for the registered scorers, the score of a well-formed but wrong answer.
        scoring: worker count, per-call timeout and process start method.
    """

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Callable[..., Any] | None = None,
                 reward_fn_key: str = "data_source", *, format_score: float = 0.0,
                 scoring: ScoringConfig = ScoringConfig()) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.format_score = format_score
        self.pool = ScorerPool(scoring)

    def __call__(self, data: DataProto) -> RewardResult:
        """data: see `decode_batch`. Returns the rewards, extra info and metrics (see `build_reward_result`);
        precomputed `rm_scores` in data.batch are returned as they are (`precomputed_reward`)."""
        if (precomputed := precomputed_reward(data)) is not None:
            return precomputed
        decoded = decode_batch(data, self.tokenizer, self.reward_fn_key)
        scored = score_each(self.pool, decoded, self.compute_score, self.format_score)
        check_error_fraction(decoded, scored, self.pool.config.max_error_fraction)
        log_examples(decoded, scored.scores, self.num_examine)
        return build_reward_result(data, decoded, scored, scored.scores)

    def close(self) -> None:
        """Stop the scorer processes."""
        self.pool.close()
