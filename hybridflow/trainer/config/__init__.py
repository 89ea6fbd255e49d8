"""The trainers' typed config trees (verl's keys): composition, `--help`, and validation before any work."""

from hybridflow.trainer.config.loader import PPO_TREE, SFT_TREE, ConfigTree, compose_config, load_config, to_typed
from hybridflow.trainer.config.schema import PPOConfig, SFTConfig
from hybridflow.trainer.config.validate import (
    BatchSizes,
    critic_enabled,
    old_log_prob_source,
    uses_reference,
    validate_config,
)

__all__ = [
    "PPO_TREE",
    "SFT_TREE",
    "BatchSizes",
    "ConfigTree",
    "PPOConfig",
    "SFTConfig",
    "compose_config",
    "critic_enabled",
    "load_config",
    "old_log_prob_source",
    "to_typed",
    "uses_reference",
    "validate_config",
]
