"""Compose a trainer's config: dataclass defaults (with verl's interpolations) <- YAML file <- overrides, then type it.

Hydra composes an untyped tree in struct mode (an unknown key fails there), OmegaConf resolves the
interpolations, and `build_config` builds the frozen dataclasses, checking every value's type and running
every component's `__post_init__`. Each failure is one ValueError naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.trainer.config.composition import compose_with_hydra, store_schema
from hybridflow.trainer.config.global_micro_batches import (
    GLOBAL_MICRO_BATCHES, SFT_GLOBAL_MICRO_BATCHES, GlobalMicroBatch, apply_global_micro_batches)
from hybridflow.trainer.config.evaluation_schema import EvaluationConfig
from hybridflow.trainer.config.generation_schema import GenerationConfig
from hybridflow.trainer.config.schema import PPO_DERIVED, PPOConfig, SFTConfig
from hybridflow.utils.config import build_config, defaults_tree, describe_fields

CONFIG_DIR = Path(__file__).resolve().parent


def rollout_mode_for(multi_turn_enabled: bool, tool_config_path: str | None = None,
                     interaction_config_path: str | None = None) -> str:
    """`rollout.mode`'s default (`${rollout_mode_for:...}` in PPO_DERIVED): agent loops (async) for multi-turn
    generation, tools or interactions, which only they run, as verl's default mode is async; else batch
    generation (sync)."""
    return "async" if multi_turn_enabled or tool_config_path or interaction_config_path else "sync"


OmegaConf.register_new_resolver("rollout_mode_for", rollout_mode_for, replace=True)


@dataclass(frozen=True)
class ConfigTree:
    """One trainer's config: its root class, packaged YAML, interpolated defaults and accepted key spellings."""

    root: type
    """The root dataclass."""
    config_name: str
    """The packaged YAML file (without .yaml) composed by default."""
    schema_name: str
    """Name under which the defaults are registered for YAML `defaults:` lists."""
    derived: Mapping[str, str] = field(default_factory=dict)
    """Keys whose default is an interpolation of another key (verl's)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other spellings verl accepts for a key (`model.partial_pretrain` -> `model.path`), rewritten in overrides."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Keys of earlier hybridflow versions -> their place now; refused with that hint."""
    config_groups: Mapping[str, str] = field(default_factory=dict)
    """verl's config-group choices (`optim=fsdp`) -> the one group this tree's section holds: that choice is
    dropped (the section is it already), any other is refused."""
    section_aliases: Mapping[str, str] = field(default_factory=dict)
    """verl's names of whole sections (`engine` -> `model.fsdp_config`): every key under one is rewritten, after
    the exact `aliases`."""
    global_micro_batches: tuple[GlobalMicroBatch, ...] = ()
    """verl's old global micro-batch keys, turned into their per-GPU forms before typing."""
    boolean_counts: frozenset[str] = frozenset()
    """Step counts that verl's scripts also write as booleans (`trainer.test_freq=False`): verl compares them as
    numbers, so False is 0 (off) and True is 1."""

    def as_written(self, message: str, overrides: Sequence[str]) -> str:
        """`message` with each aliased key spelled as the user wrote it in `overrides`."""
        for alias, key in self.aliases.items():
            if any(item.lstrip("+~").startswith(alias + "=") for item in overrides):
                message = message.replace(key, alias)
        for section, place in self.section_aliases.items():
            if any(item.lstrip("+~").startswith(section + ".") for item in overrides):
                message = message.replace(place + ".", section + ".")
        return message

    def all_keys(self) -> list[str]:
        """Every leaf key of the tree."""
        return [key for key, _ in _leaf_types(self.root, tuple(self.derived.items()))]

    def free_dict_keys(self) -> frozenset[str]:
        """The leaf keys that hold free-form dicts (`engine_kwargs`, `override_config`, `reward_kwargs`, ...)."""
        leaves = _leaf_types(self.root, tuple(self.derived.items()))
        return frozenset(key for key, type_name in leaves if type_name.startswith("dict"))


@functools.cache
def _leaf_types(root: type, derived: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """(key, type name) of every leaf of `root`'s tree (the dataclasses are fixed once imported: built once)."""
    return tuple((item.key, item.type_name) for item in describe_fields(root, derived=dict(derived)))


PPO_TREE = ConfigTree(
    PPOConfig,
    "ppo_trainer",
    "ppo_trainer_schema",
    derived=PPO_DERIVED,
    aliases={  # verl's DAPO recipe passes the overlong buffer to its reward manager as reward kwargs
        **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}": f"reward_model.overlong_buffer.{key}"
           for key in ("enable", "len", "penalty_factor", "log")},
        "reward_model.reward_kwargs.max_resp_len": "reward_model.overlong_buffer.max_resp_len",
        # verl's reward-loop workers: the processes that compute rewards, hybridflow's scorer processes
        "reward_model.num_workers": "reward_model.scoring.num_workers",
    },
    boolean_counts=frozenset({"trainer.test_freq", "trainer.save_freq"}),
    global_micro_batches=GLOBAL_MICRO_BATCHES,
    renamed={
        "ray_init": "ray_kwargs.ray_init",
        "critic.fsdp_config": "critic.model.fsdp_config",
        "reward_model.timeout_s": "reward_model.scoring.timeout_s",
    },
)
SFT_TREE = ConfigTree(
    SFTConfig,
    "sft_trainer",
    "sft_trainer_schema",
    aliases={
        "model.partial_pretrain": "model.path",
        "optim.lr_scheduler": "optim.lr_scheduler_type",
        "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
        "use_remove_padding": "model.use_remove_padding",
    },
    renamed={"ray_init": "ray_kwargs.ray_init"},
    config_groups={"optim": "fsdp"},
    global_micro_batches=SFT_GLOBAL_MICRO_BATCHES,
)


SFT_ENGINE_TREE = ConfigTree(
    SFTConfig,
    "sft_trainer_engine",
    "sft_trainer_schema",
    aliases={
        **SFT_TREE.aliases,
        "engine.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
        "data.messages_key": "data.multiturn.messages_key",
        "data.tools_key": "data.multiturn.tools_key",
        "data.enable_thinking_key": "data.multiturn.enable_thinking_key",
    },
    section_aliases={"engine": "model.fsdp_config", "checkpoint": "trainer.checkpoint"},
    renamed=SFT_TREE.renamed,
    config_groups={"optim": "fsdp", "engine": "fsdp", "model": "hf_model", "profiler": "profiler"},
    global_micro_batches=SFT_GLOBAL_MICRO_BATCHES,
)
"""verl's engine-based SFT (`verl.trainer.sft_trainer`, sft_trainer_engine.yaml): the SFT config with its defaults
(multi-turn `messages`, token-budget micro-batches, packed rows, constant lr 1e-3) and its names for the engine
(`engine.*`) and checkpoint (`checkpoint.*`) sections."""


GENERATION_TREE = ConfigTree(GenerationConfig, "generation", "generation_schema", renamed={"ray_init": "ray_kwargs.ray_init"})
GENERATION_SERVER_TREE = ConfigTree(
    GenerationConfig,
    "generation",
    "generation_schema",
    aliases={"actor_rollout_ref.rollout.n": "data.n_samples", "data.train_files": "data.path"},
    section_aliases={"actor_rollout_ref.rollout": "rollout", "actor_rollout_ref.model": "model"},
    renamed={"ray_init": "ray_kwargs.ray_init"},
)
"""verl's `main_generation_server` line (its PPO keys: actor_rollout_ref.model/rollout.*, data.train_files, the
samples as actor_rollout_ref.rollout.n) onto `hybridflow generate`'s config."""
EVALUATION_TREE = ConfigTree(EvaluationConfig, "evaluation", "evaluation_schema")


def schema_defaults(tree: ConfigTree) -> dict[str, Any]:
    """The tree's defaults as nested plain values, with the derived keys set to their interpolations."""
    defaults = defaults_tree(tree.root)
    for key, interpolation in tree.derived.items():
        *parents, leaf = key.split(".")
        node = defaults
        for part in parents:
            node = node[part]
        if leaf not in node:
            raise AssertionError(f"derived key {key} is not a field of {tree.root.__name__}")
        node[leaf] = interpolation
    return defaults


_OVERRIDE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[^=~+][^=]*?)(?P<rest>=.*)?$")


def rewrite_overrides(overrides: Sequence[str], tree: ConfigTree) -> list[str]:
    """Overrides with aliases replaced by their key; a renamed key raises ValueError with its new place."""
    rewritten = []
    known_keys = free_dicts = None
    for item in overrides:
        match = _OVERRIDE.match(item)
        if match is None:
            rewritten.append(item)
            continue
        key = match["key"].strip()
        for old, new in tree.renamed.items():
            if key == old or key.startswith(old + "."):
                raise ValueError(f"{key} is now {new + key[len(old):]}; rename it in the command line or YAML")
        prefix = match["prefix"] or ""
        if key in tree.config_groups and prefix == "" and match["rest"]:
            choice = match["rest"][1:].strip().strip("'\"")
            if choice == tree.config_groups[key]:
                continue  # verl's group of that name is what the section holds
            raise ValueError(f"{key}={choice} selects verl's {choice!r} {key} config group; hybridflow's {key} section "
                             f"is the {tree.config_groups[key]!r} group: drop {key}={choice} (set {key}.* keys instead)")
        section = next((name for name in tree.section_aliases if key.startswith(name + ".")), None)
        if key in tree.aliases or section is not None:
            key = tree.aliases[key] if key in tree.aliases else tree.section_aliases[section] + key[len(section):]
            prefix = "" if prefix == "+" else prefix  # `+` adds a key; the alias's key is in the tree already
        elif prefix in ("", "+") and _under_free_dict(key, free_dicts := free_dicts or tree.free_dict_keys()):
            # an entry of a free-form dict (`rollout.engine_kwargs.sglang.attention_backend=triton`): Hydra's struct
            # mode refuses a plain override of a missing entry and `+` of a present one; `++` sets it either way
            prefix = "++"
        elif prefix == "+":
            # verl's scripts add with `+` the keys verl lacks (`+actor_rollout_ref.actor.fsdp_config.model_dtype`);
            # where hybridflow has the key, Hydra would refuse to add it again: it is an override here
            known_keys = set(tree.all_keys()) if known_keys is None else known_keys
            prefix = "" if key in known_keys else prefix
        rest = match["rest"] or ""
        if key in tree.boolean_counts and rest.strip().lower() in ("=false", "=true"):
            rest = "=0" if rest.strip().lower() == "=false" else "=1"
        rewritten.append(f"{prefix}{key}{rest}")
    return rewritten


def _under_free_dict(key: str, free_dicts: frozenset[str]) -> bool:
    """Whether `key` names an entry inside one of the free-form dict keys (not the dict itself)."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in free_dicts for end in range(1, len(parts)))


def compose_config(
    overrides: Sequence[str] | None = None,
    tree: ConfigTree = PPO_TREE,
    config_name: str | None = None,
    config_dir: str | Path | None = None,
) -> DictConfig:
    """The merged, unresolved config for Hydra-syntax `overrides`; ValueError names a bad key."""
    from hydra.errors import HydraException

    store_schema(tree.schema_name, lambda: schema_defaults(tree))
    overrides = rewrite_overrides(list(overrides or []), tree)
    config_name, directory = config_source(config_name or tree.config_name, config_dir)
    if directory != CONFIG_DIR and not any(item.startswith("hydra.searchpath") for item in overrides):
        # a user's config that extends the packaged ones (verl's `defaults: [ppo_trainer, _self_]`) finds them
        overrides.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    try:
        return compose_with_hydra(config_name, directory, overrides, cacheable=directory == CONFIG_DIR)
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(_explain(err, tree)) from err


VERL_ONLY_CONFIGS = {
    "ppo_megatron_trainer": "verl's Megatron-LM trainer config; hybridflow trains with FSDP2 "
                            "(actor_rollout_ref.actor.strategy=fsdp2): drop --config-path/--config-name and the "
                            "*.megatron.* keys",
    "_generated_ppo_megatron_trainer": "verl's generated Megatron-LM config; hybridflow trains with FSDP2: drop "
                                       "--config-path/--config-name",
}
"""verl config names with no hybridflow counterpart, and what to do instead."""


def config_source(config_name: str, config_dir: str | Path | None) -> tuple[str, Path]:
    """The YAML config to compose: its name (a `.yaml` suffix dropped) and directory.

    verl's command lines name verl's own packaged configs as `--config-path=config --config-name=ppo_trainer`
    (relative to verl/trainer); a name found in neither the given directory nor hybridflow's packaged configs is
    refused, naming both."""
    name = config_name.removesuffix(".yaml")
    if config_dir is None:
        directory = CONFIG_DIR
    else:
        directory = Path(config_dir).expanduser().resolve()
        if not (directory / f"{name}.yaml").is_file() and (CONFIG_DIR / f"{name}.yaml").is_file():
            directory = CONFIG_DIR
    if (directory / f"{name}.yaml").is_file():
        return name, directory
    if name in VERL_ONLY_CONFIGS:
        raise ValueError(f"--config-name={config_name}: {VERL_ONLY_CONFIGS[name]}")
    packaged = sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))
    where = f"{directory} (--config-path={config_dir})" if config_dir is not None else "the packaged configs"
    raise ValueError(
        f"--config-name={config_name}: no {name}.yaml in {where}; the packaged configs are {packaged} (or give "
        "--config-path=<the directory holding your YAML>)"
    )


def _explain(err: Exception, tree: ConfigTree) -> str:
    """Hydra/OmegaConf errors, shortened to the key, the value and what to do (causes included)."""
    lines, current = [], err
    while current is not None:
        first = str(current).strip().splitlines()[0] if str(current).strip() else type(current).__name__
        if first not in lines:
            lines.append(first)
        current = current.__cause__ or current.__context__
    message = ": ".join(lines)
    missing = re.search(r"In '([^']+)': Could not load '([^']+)'", message)
    if missing and missing.group(2).removesuffix(".yaml") in VERL_ONLY_CONFIGS:
        return (f"--config-name={missing.group(1)} builds on {missing.group(2)} (its defaults list): "
                f"{VERL_ONLY_CONFIGS[missing.group(2).removesuffix('.yaml')]}")
    unknown = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", message)
    if unknown:
        key = unknown.group(1) or unknown.group(2)
        hint = next((new for old, new in tree.renamed.items() if key == old or key.startswith(old + ".")), None)
        if hint:
            message += f" ({key} is now {hint})"
        else:
            close = difflib.get_close_matches(key, tree.all_keys(), n=3, cutoff=0.6)
            message += f" (unknown key{'; did you mean ' + ', '.join(close) if close else ''}; `--help` lists every key)"
    return message


def written_keys(overrides: Sequence[str], tree: ConfigTree = PPO_TREE) -> frozenset[str]:
    """The tree keys a command line sets (aliases resolved), whatever their values."""
    keys = set()
    for item in rewrite_overrides(list(overrides), tree):
        match = _OVERRIDE.match(item)
        if match and match["rest"]:
            keys.add(match["key"])
    return frozenset(keys)


def to_typed(cfg: DictConfig, tree: ConfigTree = PPO_TREE, written: frozenset[str] = frozenset()) -> Any:
    """The frozen dataclass tree of a composed config: interpolations resolved, every value checked. `written`: the
    keys the command line sets (`written_keys`), so that a key given at its default value still counts as given."""
    if tree.global_micro_batches:
        apply_global_micro_batches(cfg, schema_defaults(tree), tree.global_micro_batches, written)
    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(_explain(err, tree)) from err
    return build_config(tree.root, values)


def load_config(
    overrides: Sequence[str] | None = None,
    tree: ConfigTree = PPO_TREE,
    config_name: str | None = None,
    config_dir: str | Path | None = None,
) -> Any:
    """Compose, type and check a trainer config (cross-component checks: `validate.validate_config`)."""
    return to_typed(compose_config(overrides, tree, config_name, config_dir), tree, written_keys(overrides or [], tree))
