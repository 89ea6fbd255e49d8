"""Checks of `hybridflow score`'s config before any scorer starts: the rows file and its columns, every row's
responses and ground truth, a scorer for every data source, and an output path that holds nothing yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridflow.data.config import expand_path
from hybridflow.rewards.config import built_in_scorer_settings, built_in_scorer_settings_error
from hybridflow.trainer.config.evaluation_schema import EvaluationConfig, EvaluationDataConfig

__all__ = ["ScoredRows", "evaluation_table", "read_scored_rows", "validate_evaluation_config"]


@dataclass(frozen=True)
class ScoredRows:
    """What scoring reads of each row, in file order."""

    data_sources: list[str]
    responses: list[list[str]]
    """Each row's responses (one string in the file is one response)."""
    ground_truths: list[Any]
    extra_infos: list[dict[str, Any]]
    """The row's `extra_info` column where the file has one, else {}."""
    prompts: Optional[list[Any]]
    """The `data.prompt_key` column where the file has it (only shown), else None."""


def validate_evaluation_config(cfg: EvaluationConfig) -> ScoredRows:
    """Raises ValueError naming the key; returns the rows to score (read once, here)."""
    data, custom = cfg.data, cfg.custom_reward_function
    if data.path is None:
        raise ValueError("data.path is required: give the parquet file of generated responses (hybridflow generate "
                         "writes one)")
    if not expand_path(data.path).is_file():
        raise ValueError(f"data.path={data.path!r} does not exist")
    if data.output_path is not None and expand_path(data.output_path).exists():
        raise ValueError(f"data.output_path={data.output_path!r} exists; scoring never writes over a file: choose "
                         "another path or move it")
    fusion = cfg.reward_model.sandbox_fusion
    changed = built_in_scorer_settings(cfg.reward_model)
    if cfg.reward_model.format_score != 0.0:
        changed["reward_model.format_score"] = cfg.reward_model.format_score
    error = built_in_scorer_settings_error(custom, changed)
    if error is not None:
        raise ValueError(error)
    workers_key = ("ray_kwargs.ray_init.num_cpus" if cfg.ray_kwargs.ray_init.num_cpus is not None
                   else "reward_model.scoring.num_workers")
    fusion.check_scorer_processes(cfg.scoring.num_workers, workers_key)
    rows = read_scored_rows(data)
    if custom.path is not None:
        from hybridflow.rewards.custom import load_custom_reward_fn

        try:
            load_custom_reward_fn(custom.path, custom.name, dict(custom.reward_kwargs))
        except (OSError, AttributeError, TypeError, ImportError, SyntaxError) as err:
            raise ValueError(f"custom_reward_function: {err}") from err
    else:
        from hybridflow.rewards.score import has_scorer

        missing = sorted({source for source in rows.data_sources if not has_scorer(source)})
        if missing:
            raise ValueError(f"{data.path}: no reward scorer for data_source {missing} (column {data.data_source_key!r}); "
                             "set custom_reward_function.path, or register one in hybridflow.rewards.score.SCORERS")
    return rows


def evaluation_table(cfg: EvaluationConfig, rows: ScoredRows) -> list[tuple[str, int]]:
    """The dry run's arithmetic: rows, responses, data sources and scorer processes."""
    return [
        ("rows (of data.path)", len(rows.data_sources)),
        ("responses", sum(len(row) for row in rows.responses)),
        ("data sources", len(set(rows.data_sources))),
        ("scorer processes", cfg.scoring.num_workers),
    ]


def read_scored_rows(data: EvaluationDataConfig) -> ScoredRows:
    """The columns of `data.path` that scoring reads (pyarrow, only those columns); a ValueError names a missing
    column or the first row whose responses or ground truth is malformed."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(expand_path(data.path))
    names = parquet.schema_arrow.names
    required = {"data.response_key": data.response_key, "data.data_source_key": data.data_source_key,
                "data.reward_model_key": data.reward_model_key}
    for key, column in required.items():
        if column not in names:
            raise ValueError(f"{key}={column!r} is not a column of {data.path}; columns: {names}")
    optional = [column for column in (data.prompt_key, "extra_info") if column in names]
    table = parquet.read(columns=sorted(set(required.values()) | set(optional)))
    sources = table.column(data.data_source_key).to_pylist()
    responses = [_responses(value, index, data) for index, value in enumerate(table.column(data.response_key).to_pylist())]
    truths = [_ground_truth(value, index, data) for index, value in enumerate(table.column(data.reward_model_key).to_pylist())]
    for index, source in enumerate(sources):
        if not isinstance(source, str) or not source:
            raise ValueError(f"{data.path} row {index}: column {data.data_source_key!r} must name a data source, got "
                             f"{source!r}")
    extra = table.column("extra_info").to_pylist() if "extra_info" in names else [None] * len(sources)
    prompts = table.column(data.prompt_key).to_pylist() if data.prompt_key in names else None
    return ScoredRows(sources, responses, truths, [dict(info) if isinstance(info, dict) else {} for info in extra],
                      prompts)


def _responses(value: Any, index: int, data: EvaluationDataConfig) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    raise ValueError(f"{data.path} row {index}: column {data.response_key!r} must hold the row's responses (a "
                     f"non-empty list of strings, or one string), got {str(value)[:120]!r}")


def _ground_truth(value: Any, index: int, data: EvaluationDataConfig) -> Any:
    if isinstance(value, dict) and value.get("ground_truth") is not None:
        return value["ground_truth"]
    raise ValueError(f"{data.path} row {index}: column {data.reward_model_key!r} must hold {{'ground_truth': ...}}, "
                     f"got {str(value)[:120]!r}")
