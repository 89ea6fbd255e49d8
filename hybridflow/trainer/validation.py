"""Validation: generate on the validation prompts (greedy or `val_kwargs.n` samples), score, aggregate.

Logged as verl does: `val-core/{data_source}/acc/mean@N` (and best@k / maj@k when N > 1), others under `val-aux/`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from hybridflow.agents.manager import agent_columns
from hybridflow.algorithms.validation_metrics import (
    flatten_validation_metrics,
    process_validation_metrics,
    validation_intervals,
)
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager.base import checked_reward_result
from hybridflow.trainer.generation import generate_batch
from hybridflow.trainer.generation_dump import dump_generations, generation_rows

logger = logging.getLogger(__name__)


SCORING_FAILURES = ("reward/errors", "reward/timeouts")
"""Scorer calls that failed (their samples scored 0), summed over the validation set as `val-aux/reward/*`."""


def run_validation(
    generator: Any, val_batches: Iterable[dict], reward_fn: Any, *, n: int, pass_rows: bool, num_examples: int = 0,
    data_dir: str | None = None, step: int = 0,
) -> dict[str, float]:
    """Validation metrics of `generator`'s policy over `val_batches`, scored by `reward_fn`.

    `n` samples per prompt (validation sampling), `pass_rows` as in `generate_batch`; `num_examples` decoded
    responses are logged with their scores; with `data_dir` (`trainer.validation_data_dir`) every sample is written
    to `data_dir/<step>.jsonl` (`generation_dump`).
    """
    data_sources: list[str] = []
    uids: list[str] = []
    infos: dict[str, list[Any]] = defaultdict(list)
    examples: list[tuple[str, float]] = []
    dumped: dict[str, list[Any]] = defaultdict(list)
    failed_scorings: dict[str, float] = defaultdict(float)
    for batch_dict in val_batches:
        batch, _ = generate_batch(generator, batch_dict, n, pass_rows=pass_rows, validate=True)
        result = checked_reward_result(reward_fn, reward_fn(batch), len(batch))
        for key in SCORING_FAILURES:
            failed_scorings[f"val-aux/{key}"] += float(result.metrics.get(key, 0.0))
        scores = result.reward_tensor.sum(-1).tolist()
        rows_before = len(uids)
        columns = {"reward": scores, **{key: values for key, values in result.extra_info.items()
                                          if len(values) == len(batch)}, **agent_columns(batch)}
        append_columns(infos, columns, rows_before, len(batch))
        if data_dir is not None:
            rows = {**generation_rows(batch, reward_fn.tokenizer, scores), **result.extra_info}
            for key, values in rows.items():
                if len(values) == len(batch):
                    dumped[key].extend(values)
        data_sources.extend(batch.non_tensor_batch["data_source"].tolist())
        uids.extend(batch.non_tensor_batch["uid"].tolist())
        if len(examples) < num_examples:
            examples.extend(_decode_examples(reward_fn.tokenizer, batch, scores, num_examples))
    for text, score in examples[:num_examples]:
        logger.info("validation sample (score %.2f): %s", score, text)
    if data_dir is not None and dumped:
        dump_generations(data_dir, step, dumped)
    infos = {key: values for key, values in infos.items() if len(values) == len(uids)}
    metrics = flatten_validation_metrics(process_validation_metrics(data_sources, uids, infos))
    if any(failed_scorings.values()):
        logger.warning("validation: %s: those samples scored 0, so the accuracy above understates the policy",
                       ", ".join(f"{int(v)} {k.split('/')[-1]}" for k, v in failed_scorings.items() if v))
    return {**metrics, **validation_intervals(data_sources, uids, infos), **failed_scorings}


def append_columns(infos: dict[str, list[Any]], columns: dict[str, list[Any]], rows_before: int, rows: int) -> None:
    """Append one batch's per-sample `columns` (`rows` values each) to `infos`, which hold `rows_before` values
    each: a column a batch lacks (a scorer key only some data sources return) is None there, which the metrics
    leave out, so it is kept for the samples that have it rather than dropped for the whole set."""
    for key, values in columns.items():
        infos.setdefault(key, [None] * rows_before).extend(values)
    for values in infos.values():
        values.extend([None] * (rows_before + rows - len(values)))


def _decode_examples(tokenizer: Any, batch: DataProto, scores: list[float], limit: int) -> list[tuple[str, float]]:
    texts = []
    for row in range(min(len(batch), limit)):
        mask = batch.batch["response_mask"][row].bool()
        texts.append((tokenizer.decode(batch.batch["responses"][row][mask]), scores[row]))
    return texts
