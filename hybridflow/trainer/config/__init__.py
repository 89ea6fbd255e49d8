"""Typed trainer config (Hydra structured configs with verl's keys), composition and validation."""

from hybridflow.trainer.config.loader import compose_config, load_config, to_typed
from hybridflow.trainer.config.schema import PPOConfig
from hybridflow.trainer.config.validate import BatchSizes, critic_enabled, uses_reference, validate_config

__all__ = [
    "BatchSizes",
    "PPOConfig",
    "compose_config",
    "critic_enabled",
    "load_config",
    "to_typed",
    "uses_reference",
    "validate_config",
]
