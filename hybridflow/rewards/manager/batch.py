"""The `batch` reward manager: one call scores the whole batch (for scorers that batch, e.g. a model judge)."""

from __future__ import annotations

import functools
import logging

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import (
    DecodedBatch, RewardManager, RewardResult, build_reward_result, check_error_fraction,
    log_examples, unpack_outcomes)
from hybridflow.rewards.pool import ScoreOutcome
from hybridflow.rewards.score import default_compute_score_batched, resolve_scorer

__all__ = ["BatchRewardManager"]

logger = logging.getLogger(__name__)


class BatchRewardManager(RewardManager):
    """Rewards from one `compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)` call
    returning one float or dict per sample. The call runs in a scorer process with `scoring.timeout_s` for
    the whole batch; if it raises or times out, every sample scores 0 and is counted.

    Args: see `RewardManager`; `compute_score` None uses the registered scorers sample by sample.
    """

    def score_decoded(self, data: DataProto, decoded: DecodedBatch) -> RewardResult:
        fn = self.compute_score
        if fn is None:
            for data_source in set(decoded.data_sources):
                resolve_scorer(data_source)  # an unknown data source fails here, in the driver
            fn = functools.partial(default_compute_score_batched, format_score=self.format_score,
                                   sandbox=self.pool.config.sandbox, remote_sandbox=self.remote_sandbox)
        kwargs = {"data_sources": decoded.data_sources, "solution_strs": decoded.response_strs,
                  "ground_truths": decoded.ground_truths, "extra_infos": decoded.extra_infos}
        [outcome] = self.pool.run([(fn, kwargs)])
        outcomes = _split(outcome, len(decoded.data_sources))
        scored = unpack_outcomes(outcomes)
        check_error_fraction(decoded, scored, self.pool.config.max_error_fraction)
        log_examples(decoded, scored.scores, self.num_examine)
        return build_reward_result(data, decoded, scored, scored.scores)


def _split(outcome: ScoreOutcome, batch_size: int) -> list[ScoreOutcome]:
    """One batch outcome -> per-sample outcomes (a failed or malformed batch fails every sample)."""
    if outcome.status != "ok":
        return [outcome] * batch_size
    values = outcome.value
    if not isinstance(values, (list, tuple)) or len(values) != batch_size:
        message = f"batched compute_score must return a list of {batch_size} scores, got {type(values).__name__}"
        logger.warning("%s; every sample scores 0 (counted in reward/errors)", message)
        return [ScoreOutcome("error", message=message)] * batch_size
    return [ScoreOutcome("ok", value) for value in values]
