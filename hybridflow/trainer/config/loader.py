"""Compose the trainer config: schema defaults <- YAML file <- command-line overrides, then type it and check it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.trainer.config.schema import PPOConfig

CONFIG_DIR = Path(__file__).resolve().parent
SCHEMA_NAME = "ppo_trainer_schema"


def _unlock(node: Any) -> None:
    """Frozen dataclasses give read-only nodes at every level; overrides must be able to change values."""
    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                _unlock(child)


def schema_node(schema: type = PPOConfig) -> DictConfig:
    """The structured config of `schema` with writable values (types and keys still enforced)."""
    node = OmegaConf.structured(schema)
    _unlock(node)
    return node


def _register_schema(name: str, schema: type) -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=schema_node(schema))


def compose_config(
    overrides: list[str] | None = None,
    config_name: str = "ppo_trainer",
    config_dir: str | Path | None = None,
    schema: type = PPOConfig,
    schema_name: str = SCHEMA_NAME,
) -> DictConfig:
    """The merged (untyped) config for `overrides` in Hydra's override syntax; ValueError names a bad key."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    _register_schema(schema_name, schema)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir or CONFIG_DIR).resolve()), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(_explain(err)) from err


def _explain(err: Exception) -> str:
    """Hydra/OmegaConf errors, shortened to the key, the value and what to do (causes included)."""
    lines, key, current = [], None, err
    while current is not None:
        first = str(current).strip().splitlines()[0] if str(current).strip() else type(current).__name__
        if first not in lines:
            lines.append(first)
        key = key or getattr(current, "full_key", None)
        current = current.__cause__ or current.__context__
    message = ": ".join(lines)
    if "Could not override" in message or "not in struct" in message:
        message += " (unknown key: check the spelling; `--cfg job` prints every key)"
    return message + (f" (key: {key})" if key and key not in message else "")


def to_typed(cfg: DictConfig, schema: type = PPOConfig) -> Any:
    """The frozen dataclass tree for `cfg`; runs every `__post_init__` check."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ValueError(_explain(err)) from err


def load_config(overrides: list[str] | None = None, config_name: str = "ppo_trainer") -> PPOConfig:
    """Compose, type and check the trainer config (cross-component checks: `validate.validate_config`)."""
    return to_typed(compose_config(overrides, config_name))
