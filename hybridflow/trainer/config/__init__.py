"""The trainers' typed config trees (verl's keys): composition, `--help`, and validation before any work."""

from hybridflow.trainer.config.loader import PPO_TREE, SFT_TREE, ConfigTree, compose_config, load_config, to_typed
from hybridflow.trainer.config.schema import PPOConfig, SFTConfig
from hybridflow.trainer.config.validate import BatchSizes, validate_config


__all__ = [
    "PPO_TREE",
    "SFT_TREE",
    "BatchSizes",
    "ConfigTree",
    "PPOConfig",
    "SFTConfig",
    "compose_config",
    "load_config",
    "to_typed",
    "validate_config",
]
