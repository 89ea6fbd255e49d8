"""`hybridflow score` (verl's `main_eval`): score every response of a parquet file (what `hybridflow generate`
writes) with the scorer of its row's data source, or a custom reward function, and report per data source.

    hybridflow generate data.path=test.parquet data.output_path=gen.parquet data.n_samples=4 model.path=...
    hybridflow score data.path=gen.parquet data.output_path=scored.parquet

Scorers run in the reward stage's scorer processes (`reward_model.scoring`): a scorer that raises or hangs scores
0 and is counted per data source, and model-written code runs in the sandbox. The last line printed is verl's
dict, `{'test_score/<data_source>': mean}`, each row's mean score averaged over the rows.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any

from hybridflow.data.config import expand_path
from hybridflow.data.new_parquet import write_new_parquet
from hybridflow.rewards.manager.base import DecodedBatch, ScoredBatch, check_error_fraction, sample_accuracy
from hybridflow.rewards.manager.naive import score_each
from hybridflow.rewards.pool import ScorerPool
from hybridflow.trainer.config.evaluation_checks import ScoredRows
from hybridflow.trainer.config.evaluation_schema import EvaluationConfig

__all__ = ["format_report", "report_by_source", "row_spans", "run_evaluation"]

logger = logging.getLogger(__name__)
Z95 = 1.959964


def report_by_source(rows: ScoredRows, scored: ScoredBatch) -> dict[str, dict[str, float]]:
    """Per data source: rows, responses, `score` (each row's mean score, averaged over rows: verl's test_score)
    with its 95% half-width over rows, `acc` (the same for the scorer's 'acc', else score >= 1), `pass@n` (rows with
    a correct response), and failed scorer calls (`errors`, `timeouts`). `scored` holds the responses flattened
    row by row."""
    report: dict[str, dict[str, Any]] = {}
    for source, span in zip(rows.data_sources, row_spans(rows)):
        scores = scored.scores[span]
        correct = [sample_accuracy(score, detail) for score, detail in zip(scores, scored.details[span])]
        entry = report.setdefault(source, {"row_scores": [], "row_accs": [], "passed": 0, "responses": 0,
                                           "errors": 0, "timeouts": 0})
        entry["row_scores"].append(sum(scores) / len(scores))
        entry["row_accs"].append(sum(correct) / len(correct))
        entry["passed"] += int(max(correct) >= 1.0)
        entry["responses"] += len(scores)
        entry["errors"] += sum(scored.errored[span])
        entry["timeouts"] += sum(scored.timed_out[span])
    return {source: _summary(entry) for source, entry in sorted(report.items())}


def row_spans(rows: ScoredRows) -> list[slice]:
    """Each row's responses in the flattened, row-by-row order that scoring uses (`_flatten`)."""
    ends = list(itertools.accumulate(len(responses) for responses in rows.responses))
    return [slice(end - len(responses), end) for end, responses in zip(ends, rows.responses)]


def _summary(entry: dict[str, Any]) -> dict[str, float]:
    num_rows = len(entry["row_scores"])
    return {
        "rows": num_rows,
        "responses": entry["responses"],
        "score": _mean(entry["row_scores"]),
        "score_ci95": _half_width(entry["row_scores"]),
        "acc": _mean(entry["row_accs"]),
        "acc_ci95": _half_width(entry["row_accs"]),
        "pass@n": entry["passed"] / num_rows,
        "errors": entry["errors"],
        "timeouts": entry["timeouts"],
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _half_width(values: Sequence[float]) -> float:
    """1.96 standard errors of the mean of `values` (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    variance = sum((value - mean) ** 2 for value in values) / (len(values) - 1)
    return Z95 * math.sqrt(variance / len(values))


def format_report(report: dict[str, dict[str, float]]) -> str:
    """One line per data source: rows, responses, mean score and accuracy with their 95% intervals, pass@n, and
    the failed scorer calls."""
    header = (f"{'data source':<28} {'rows':>6} {'responses':>9} {'score [95% CI]':>22} {'acc [95% CI]':>22} "
              f"{'pass@n':>7} {'errors':>6} {'timeouts':>8}")
    lines = [header]
    for source, entry in report.items():
        score = f"{entry['score']:.4f} +- {entry['score_ci95']:.4f}"
        acc = f"{entry['acc']:.4f} +- {entry['acc_ci95']:.4f}"
        lines.append(f"{source:<28} {entry['rows']:>6} {entry['responses']:>9} {score:>22} {acc:>22} "
                     f"{entry['pass@n']:>7.4f} {entry['errors']:>6} {entry['timeouts']:>8}")
    return "\n".join(lines)


def _flatten(rows: ScoredRows) -> DecodedBatch:
    """One entry per response, row by row, with its row's data source, ground truth and extra info."""
    counts = [len(responses) for responses in rows.responses]
    prompts = rows.prompts if rows.prompts is not None else [""] * len(counts)

    def repeat(values: Sequence[Any]) -> list[Any]:
        return [value for value, count in zip(values, counts) for _ in range(count)]

    texts = [text for responses in rows.responses for text in responses]
    return DecodedBatch(prompt_strs=[str(prompt) for prompt in repeat(prompts)], response_strs=texts,
                        valid_response_lengths=[len(text) for text in texts],  # characters: no tokens offline
                        data_sources=repeat(rows.data_sources), ground_truths=repeat(rows.ground_truths),
                        extra_infos=[dict(info) for info in repeat(rows.extra_infos)])


def run_evaluation(cfg: EvaluationConfig, rows: ScoredRows) -> dict[str, float]:
    """Score `rows` (read by `validate_evaluation_config`), print the report and verl's dict, write
    `data.output_path` when set; returns {'test_score/<ds>': mean, '<ds>/<column>': ...}."""
    compute_score = None
    custom = cfg.custom_reward_function
    if custom.path is not None:
        from hybridflow.rewards.custom import load_custom_reward_fn

        compute_score = load_custom_reward_fn(custom.path, custom.name, dict(custom.reward_kwargs))
    decoded = _flatten(rows)
    pool = ScorerPool(cfg.scoring)
    try:
        logger.info("scoring %d responses of %d rows with %d scorer processes", len(decoded.response_strs),
                    len(rows.data_sources), cfg.scoring.num_workers)
        scored = score_each(pool, decoded, compute_score, cfg.reward_model.format_score,
                            cfg.reward_model.sandbox_fusion.endpoint())
    finally:
        pool.close()
    check_error_fraction(decoded, scored, cfg.scoring.max_error_fraction)
    report = report_by_source(rows, scored)
    _log_examples(rows, scored)
    print(format_report(report))
    if cfg.data.output_path is not None:
        _write_scores(cfg, rows, scored)
    verl_metrics = {f"test_score/{source}": entry["score"] for source, entry in report.items()}
    print(verl_metrics)
    return {**verl_metrics, **{f"{source}/{column}": value for source, entry in report.items()
                               for column, value in entry.items()}}


def _log_examples(rows: ScoredRows, scored: ScoredBatch) -> None:
    """The first response of each data source's first row, at INFO."""
    shown: set[str] = set()
    for index, (source, span) in enumerate(zip(rows.data_sources, row_spans(rows))):
        if source not in shown:
            shown.add(source)
            prompt = rows.prompts[index] if rows.prompts is not None else None
            logger.info("[%s] [prompt] %s\n[response] %s\n[ground_truth] %s\n[score] %s", source, prompt,
                        rows.responses[index][0], rows.ground_truths[index], scored.scores[span.start])


def _write_scores(cfg: EvaluationConfig, rows: ScoredRows, scored: ScoredBatch) -> None:
    """The input rows with a `scores` column (each response's score, in order), never over a file."""
    import pandas as pd

    frame = pd.read_parquet(expand_path(cfg.data.path))
    frame["scores"] = [scored.scores[span] for span in row_spans(rows)]
    target = write_new_parquet(frame, cfg.data.output_path, "data.output_path")
    logger.info("wrote %d rows with their scores to %s", len(frame), target)
