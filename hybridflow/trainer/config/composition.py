"""Hydra composition of a trainer's config, with the packaged configs' composition cached.

A full Hydra compose (its defaults list, its own `hydra` node, the schema node deep-copied from the ConfigStore)
costs about 0.1 s; a dry run, every config check and the test suite compose hundreds of times. Hydra composes in
two phases: the defaults list gives a merged config, then `ConfigLoaderImpl._apply_overrides_to_config` applies
the overrides that are not config-group choices, in struct mode. For a packaged config (hybridflow's own
directory, which holds no config groups) the first phase does not depend on the overrides, so it runs once per
config and YAML version, and each call applies its overrides to a deep copy with Hydra's own function and parser:
same values, same errors. Anything else (a user's `--config-path`, an override of Hydra's own keys or a config
group, a sweep, a package) takes Hydra's whole path.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["compose_with_hydra", "store_schema"]

_STORED_SCHEMAS: set[str] = set()
"""Schema names stored in Hydra's ConfigStore (built once per process)."""
_COMPOSED: dict[tuple, DictConfig] = {}
"""(config name, directory, YAML versions) -> the config composed without overrides (the schemas it extends are
stored once per process and never change)."""


def store_schema(name: str, defaults: Any) -> None:
    """Register the schema's defaults (a plain tree, or a callable building it) in Hydra's ConfigStore, once."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if name not in _STORED_SCHEMAS or f"{name}.yaml" not in store.repo:
        store.store(name=name, node=OmegaConf.create(defaults() if callable(defaults) else defaults))
        _STORED_SCHEMAS.add(name)


def compose_with_hydra(config_name: str, directory: Path, overrides: Sequence[str], *, cacheable: bool) -> DictConfig:
    """The composed config (no `hydra` node, struct mode). `cacheable`: `directory` holds no config groups, so
    the composition without overrides may be reused (see the module docstring); the caller must have stored
    the schema (`store_schema`). Raises Hydra's and OmegaConf's own exceptions."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    if not cacheable or _has_groups(directory) or not all(_plain_key_override(item) for item in parsed):
        return _compose_fully(config_name, directory, overrides)
    key = (config_name, str(directory), _yaml_versions(directory))
    if key not in _COMPOSED:
        _COMPOSED[key] = _compose_fully(config_name, directory, [])
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    composed = copy.deepcopy(_COMPOSED[key])
    ConfigLoaderImpl._apply_overrides_to_config(parsed, composed)  # Hydra's second phase, as compose runs it
    return composed


def _compose_fully(config_name: str, directory: Path, overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def _plain_key_override(override: Any) -> bool:
    """Whether Hydra would apply `override` to the composed config (second phase) and nothing else: not a sweep,
    not a package, not Hydra's own keys, and not naming a config group (Hydra's or the ConfigStore's)."""
    from hydra.core.config_store import ConfigStore

    if override.is_sweep_override() or override.is_hydra_override() or override.package is not None:
        return False
    node: Any = ConfigStore.instance().repo
    for part in override.key_or_group.split("/"):
        if not isinstance(node, dict) or part not in node:
            return "/" not in override.key_or_group
        node = node[part]
    return not isinstance(node, dict)  # a ConfigStore group of that name: Hydra picks a config from it


def _has_groups(directory: Path) -> bool:
    """Whether `directory` holds config groups (subdirectories with YAML files), whose choices overrides may
    change; others (`__pycache__`) are not Hydra's."""
    return any(path.is_dir() and any(path.rglob("*.yaml")) for path in directory.iterdir())


def _yaml_versions(directory: Path) -> tuple[tuple[str, int], ...]:
    """The YAML files of `directory` with their modification times: an edited file is composed again."""
    return tuple(sorted((path.name, path.stat().st_mtime_ns) for path in directory.glob("*.yaml")))
