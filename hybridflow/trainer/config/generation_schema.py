"""The config of `hybridflow generate` (verl's `main_generation` keys, `verl/trainer/config/generation.yaml`):
sample responses for every prompt of a parquet file and write them beside the rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hybridflow.data.config import expand_path
from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.models.config import ModelConfig
from hybridflow.trainer.config.schema import RayKwargsConfig, WorkerPlacement
from hybridflow.utils.config import ConfigFieldError, check_positive, unsupported
from hybridflow.workers.config import Strategy

__all__ = ["GenerationActorConfig", "GenerationConfig", "GenerationDataConfig", "GenerationRunConfig"]


@dataclass(frozen=True, kw_only=True)
class GenerationRunConfig(WorkerPlacement):
    """Where the generation workers run (verl's `trainer.*` of generation.yaml). Each rank generates its share of a
    batch; with rollout.tensor_model_parallel_size=k, k ranks form one replica."""

    default_local_dir: str = "outputs/generation"
    """Where the stacks of hung workers are written when a call times out."""

    def local_dir(self) -> Path:
        """`default_local_dir` as a path (`~` expanded), as `RunConfig.local_dir` gives a trainer's."""
        return expand_path(self.default_local_dir)


@dataclass(frozen=True, kw_only=True)
class GenerationDataConfig:
    """The prompts and where the responses go (verl's `data.*` of generation.yaml)."""

    path: Optional[str] = None
    """Parquet file of the prompts (`~` expanded); required."""
    prompt_key: str = "prompt"
    """Column of each row's chat messages (a list of {role, content})."""
    n_samples: int = 5
    """Responses per prompt, each from its own sampling stream."""
    output_path: Optional[str] = None
    """Parquet file to write: the input rows with a `responses` column (a list of n_samples strings per row).
    It must not exist yet: nothing is written over."""
    batch_size: int = 128
    """Prompts per generation call over all ranks."""
    trust_remote_code: bool = False
    """Load a tokenizer with custom code."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's apply_chat_template (e.g. enable_thinking)."""

    def __post_init__(self) -> None:
        check_positive("n_samples", self.n_samples)
        check_positive("batch_size", self.batch_size)
        if not self.prompt_key:
            raise ConfigFieldError("prompt_key", "prompt_key must name a column, got an empty string")


@dataclass(frozen=True, kw_only=True)
class GenerationFSDPConfig:
    """verl's `actor.fsdp_config` of generation.yaml, kept for backward compatibility: no trainer is built."""

    fsdp_size: int = unsupported(-1, "generation builds no training engine to shard")
    """verl: FSDP group size."""
    forward_prefetch: bool = unsupported(False, "generation builds no training engine")
    """verl: FSDP1's forward prefetch."""


@dataclass(frozen=True, kw_only=True)
class GenerationActorConfig:
    """verl's `actor.*` of generation.yaml (for backward compatibility: the rollout workers train nothing)."""

    strategy: Strategy = "fsdp"
    """verl's training engine of the worker that hosts the rollout; both values host it the same way here."""
    ulysses_sequence_parallel_size: int = unsupported(1, "generation runs no training forward to split")
    """verl: sequence parallel size."""
    entropy_from_logits_with_chunking: bool = unsupported(False, "generation computes no entropy")
    """verl: chunked entropy."""
    entropy_checkpointing: bool = unsupported(False, "generation computes no entropy")
    """verl: recomputed entropy."""
    fsdp_config: GenerationFSDPConfig = field(default_factory=GenerationFSDPConfig)
    """verl: sharding of the actor."""


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """The whole `hybridflow generate` config (verl's main_generation keys)."""

    trainer: GenerationRunConfig = field(default_factory=GenerationRunConfig)
    data: GenerationDataConfig = field(default_factory=GenerationDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: GenerationActorConfig = field(default_factory=GenerationActorConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
