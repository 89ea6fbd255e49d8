"""DAPO's dynamic sampling (`algorithm.filter_groups`): keep the prompt groups whose samples disagree on a
metric, and generate more batches until a step has `data.train_batch_size` of them.

A group whose samples all score alike has zero GRPO advantage everywhere: it costs an update and teaches
nothing. The bookkeeping here is pure (numpy and `DataProto` selection); the driver owns the generation loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto

__all__ = [
    "GroupFilter", "TooManyGenerationBatches", "filter_metric_values", "informative_rows", "merge_generation_metrics",
]

SEQUENCE_METRICS = ("seq_reward", "seq_final_reward")
"""Metrics computed from the batch's token rewards rather than read from the reward manager's columns."""


class TooManyGenerationBatches(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` generation batches did not fill a training batch."""


def filter_metric_values(
    metric: str, token_level_scores: torch.Tensor, extra_info: Mapping[str, Sequence[Any]]
) -> np.ndarray:
    """Per-sample values of `metric`: a sequence's summed reward (`seq_reward`, `seq_final_reward`) or a column
    the reward manager returned (`acc`, `score`, or a key a scorer returns)."""
    if metric in SEQUENCE_METRICS:
        return token_level_scores.sum(dim=-1).double().numpy()
    if metric not in extra_info:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward manager returned no such per-sample column; "
            f"available: {sorted(extra_info) + list(SEQUENCE_METRICS)}"
        )
    return np.asarray(extra_info[metric], dtype=np.float64)


def informative_rows(uids: Sequence[str], values: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Rows of the groups (same `uid`) whose values are not all equal, or that hold a single sample.

    Returns (row indices in batch order, number of kept groups, number of dropped groups).
    """
    groups: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    kept_rows: list[int] = []
    kept = 0
    for rows in groups.values():
        if len(rows) == 1 or float(np.std(values[rows])) > 0:
            kept_rows.extend(rows)
            kept += 1
    return np.asarray(sorted(kept_rows), dtype=np.int64), kept, len(groups) - kept


class GroupFilter:
    """Accumulates informative prompt groups over generation batches until a training batch is full.

    `add` takes a scored generation batch; `full` tells when `num_prompts` groups are in; `take` returns the
    first `num_prompts * n` rows (verl drops the surplus) and the step's `filter_groups/*` metrics.
    """

    def __init__(self, metric: str, num_prompts: int, n: int, max_num_gen_batches: int) -> None:
        self.metric, self.num_prompts, self.n = metric, num_prompts, n
        self.max_num_gen_batches = max_num_gen_batches
        self.kept: list[DataProto] = []
        self.num_gen_batches = self.kept_groups = self.dropped_groups = 0

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.num_prompts

    def add(self, batch: DataProto, extra_info: Mapping[str, Sequence[Any]]) -> None:
        """Keep `batch`'s informative groups; raise `TooManyGenerationBatches` when the limit is reached unfilled."""
        values = filter_metric_values(self.metric, batch.batch["token_level_scores"], extra_info)
        rows, kept, dropped = informative_rows(batch.non_tensor_batch["uid"].tolist(), values)
        self.num_gen_batches += 1
        self.kept_groups += kept
        self.dropped_groups += dropped
        if len(rows):
            self.kept.append(batch.select_idxs(rows))
        limit = self.max_num_gen_batches
        if not self.full and limit > 0 and self.num_gen_batches >= limit:
            raise TooManyGenerationBatches(
                f"algorithm.filter_groups: {self.num_gen_batches} generation batches gave {self.kept_groups} prompt "
                f"groups whose {self.metric!r} varies, fewer than data.train_batch_size={self.num_prompts}. The data "
                "may be too hard or too easy for the policy; raise algorithm.filter_groups.max_num_gen_batches "
                "(0: no limit) or data.gen_batch_size"
            )

    def take(self) -> tuple[DataProto, dict[str, float]]:
        """The training batch (exactly `num_prompts` groups) and the step's bookkeeping metrics."""
        if not self.full:
            raise RuntimeError(f"only {self.kept_groups} of {self.num_prompts} prompt groups are in")
        batch = DataProto.concat(self.kept)
        batch = batch.select_idxs(np.arange(self.num_prompts * self.n))
        seen = self.kept_groups + self.dropped_groups
        metrics = {
            "train/num_gen_batches": float(self.num_gen_batches),
            "filter_groups/kept_groups": float(self.kept_groups),
            "filter_groups/dropped_groups": float(self.dropped_groups),
            "filter_groups/kept_fraction": self.kept_groups / seen,
            "filter_groups/surplus_groups": float(self.kept_groups - self.num_prompts),
        }
        return batch, metrics


COUNT_METRICS = ("reward/errors", "reward/timeouts")
"""Metrics that count events: summed over a step's generation batches (the others are averaged)."""


def merge_generation_metrics(per_batch: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from those of its generation batches: counts summed, the rest averaged."""
    merged: dict[str, float] = {}
    for key in {key for metrics in per_batch for key in metrics}:
        values = [metrics[key] for metrics in per_batch if key in metrics]
        merged[key] = float(sum(values)) if key in COUNT_METRICS else float(np.mean(values))
    return merged
