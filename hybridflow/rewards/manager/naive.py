"""The `naive` reward manager: score each response on its own with the rule scorer of its data source."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import (
    DecodedBatch, RewardManager, RewardResult, bind_scorers, build_reward_result,
    check_error_fraction, log_examples, unpack_outcomes)
from hybridflow.rewards.pool import ScorerPool
from hybridflow.sandbox.remote import SandboxFusionEndpoint

__all__ = ["NaiveRewardManager", "score_each"]


def score_each(pool: ScorerPool, decoded: Any, compute_score: Callable[..., Any] | None, format_score: float,
               remote_sandbox: SandboxFusionEndpoint | None = None) -> Any:
    """Run one scorer call per sample through `pool` (code scorers' cases on `remote_sandbox` when given);
    returns a `ScoredBatch`."""
    scorers = bind_scorers(compute_score, decoded.data_sources, format_score, pool.config.sandbox, remote_sandbox)
    calls = [
        (scorers[ds], {"data_source": ds, "solution_str": sol, "ground_truth": gt, "extra_info": info})
        for ds, sol, gt, info in zip(decoded.data_sources, decoded.response_strs, decoded.ground_truths,
                                     decoded.extra_infos)
    ]
    return unpack_outcomes(pool.run(calls))


class NaiveRewardManager(RewardManager):
    """Rule-based rewards, one scorer call per sample, in worker processes with a timeout (arguments: see
    `RewardManager`)."""

    def score_decoded(self, data: DataProto, decoded: DecodedBatch) -> RewardResult:
        scored = score_each(self.pool, decoded, self.compute_score, self.format_score, self.remote_sandbox)
        check_error_fraction(decoded, scored, self.pool.config.max_error_fraction)
        log_examples(decoded, scored.scores, self.num_examine)
        return build_reward_result(data, decoded, scored, scored.scores)
