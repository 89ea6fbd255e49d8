"""The config of `hybridflow score` (verl's `main_eval` keys, `verl/trainer/config/evaluation.yaml`): score the
responses of a parquet file (what `hybridflow generate` writes) per data source, offline."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from hybridflow.rewards.config import CustomRewardFunctionConfig, SandboxFusionConfig
from hybridflow.rewards.pool import ScoringConfig
from hybridflow.utils.config import ConfigFieldError, check_positive, unsupported

__all__ = ["EvaluationConfig", "EvaluationDataConfig", "EvaluationRayKwargs", "EvaluationRewardConfig"]


@dataclass(frozen=True, kw_only=True)
class EvaluationDataConfig:
    """The generated rows and their columns (verl's `data.*` of evaluation.yaml)."""

    path: Optional[str] = None
    """Parquet file of the rows to score (`~` expanded); required."""
    prompt_key: str = "prompt"
    """Column of each row's prompt. Only shown: the first row of each data source is logged with its prompt,
    response, ground truth and score when this column exists."""
    response_key: str = "responses"
    """Column of each row's responses: a list of strings (`hybridflow generate`'s output), or one string."""
    data_source_key: str = "data_source"
    """Column naming each row's data source, which picks its scorer."""
    reward_model_key: str = "reward_model"
    """Column of each row's {'ground_truth': ...}."""
    output_path: Optional[str] = None
    """Parquet file to write, optional: the input rows with a `scores` column (each response's score, in order).
    It must not exist yet: nothing is written over."""

    def __post_init__(self) -> None:
        for name in ("prompt_key", "response_key", "data_source_key", "reward_model_key"):
            if not getattr(self, name):
                raise ConfigFieldError(name, f"{name} must name a column, got an empty string")


@dataclass(frozen=True, kw_only=True)
class EvaluationRewardConfig:
    """How the scorers run (the `reward_model.*` keys of `hybridflow train` that apply offline)."""

    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Scorer processes and the per-call timeout: a raising or hung scorer scores 0 and is counted, per data
    source; more than scoring.max_error_fraction failed calls stop the evaluation, naming the data sources."""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """verl's remote code sandbox: with a url, the code scorers' test cases run there."""
    format_score: float = 0.0
    """For the built-in scorers that take one: the score of a well-formed but wrong answer (the server's capacity
    against the scorer processes is checked with ray_kwargs.ray_init.num_cpus, which may set their count)."""


@dataclass(frozen=True, kw_only=True)
class EvaluationRayInit:
    """verl's `ray_kwargs.ray_init` of evaluation.yaml: verl scores each row as a Ray task on this many CPUs."""

    num_cpus: Optional[int] = None
    """Scorer processes (verl: the CPUs Ray scores on); None keeps reward_model.scoring.num_workers."""
    address: Optional[str] = unsupported(None, "hybridflow score runs its scorers in processes on this machine, "
                                         "with a per-call timeout; no Ray cluster is joined")
    """verl: a Ray cluster to score on."""

    def __post_init__(self) -> None:
        check_positive("num_cpus", self.num_cpus, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class EvaluationRayKwargs:
    """verl's `ray_kwargs` of evaluation.yaml."""

    ray_init: EvaluationRayInit = field(default_factory=EvaluationRayInit)
    """verl's arguments of ray.init."""
    timeline_json_file: Optional[str] = unsupported(None, "hybridflow score runs no Ray tasks to trace")
    """verl: Ray's timeline of the scoring tasks."""


@dataclass(frozen=True, kw_only=True)
class EvaluationConfig:
    """The whole `hybridflow score` config (verl's main_eval keys)."""

    data: EvaluationDataConfig = field(default_factory=EvaluationDataConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A scoring function from a file, called for every response; None uses the scorer of each row's data source."""
    reward_model: EvaluationRewardConfig = field(default_factory=EvaluationRewardConfig)
    ray_kwargs: EvaluationRayKwargs = field(default_factory=EvaluationRayKwargs)

    @property
    def scoring(self) -> ScoringConfig:
        """reward_model.scoring with ray_kwargs.ray_init.num_cpus as its process count when that is set."""
        num_cpus = self.ray_kwargs.ray_init.num_cpus
        scoring = self.reward_model.scoring
        return scoring if num_cpus is None else replace(scoring, num_workers=num_cpus)
