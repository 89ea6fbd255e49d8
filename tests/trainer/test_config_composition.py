"""The cached composition of the packaged configs gives what Hydra's whole compose gives: the same values for
every kind of override, the same errors, fresh copies, and a new composition once a YAML file changes."""

from __future__ import annotations

import os
import shutil

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hybridflow.trainer.config import composition
from hybridflow.trainer.config.composition import compose_with_hydra, store_schema
from hybridflow.trainer.config.loader import CONFIG_DIR, PPO_TREE, SFT_TREE, rewrite_overrides, schema_defaults

OVERRIDES = [
    [],
    ["data.train_batch_size=8", "actor_rollout_ref.actor.optim.lr=3e-6", "trainer.logger=[console,wandb]"],
    ["+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4", "trainer.project_name='a b'",
     "trainer.experiment_name=null"],
    ["~critic.model.override_config", "data.max_prompt_length=${data.max_response_length}"],
    ["algorithm.kl_ctrl.kl_coef=0.001", "reward_model.reward_kwargs.overlong_buffer_cfg.len=512",
     "+actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16", "trainer.test_freq=False"],
    ["data.train_files=[a.parquet,b.parquet]", "trainer=3"],  # a section replaced by a value (typing refuses it)
    # refused by Hydra, with its own message
    ["trainer.no_such_key=1"],
    ["+trainer.total_epochs=3"],  # adding a key that exists
    ["~trainer.no_such_key"],
    ["data.train_batch_size=1,2"],  # a sweep in a single run
    ["data.train_batch_size"],  # no value
    ["actor_rollout_ref.model.override_config={attention_dropout: 0.0}"],  # a dict into a struct dict without +
]


def _outcome(compose, overrides):
    """('ok', the plain tree, struct flag) or ('error', exception type, message)."""
    try:
        composed = compose(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        return ("error", type(err), str(err))
    return ("ok", OmegaConf.to_container(composed), OmegaConf.is_struct(composed), "hydra" in composed)


@pytest.mark.parametrize("overrides", OVERRIDES)
def test_cached_composition_equals_hydras_whole_compose(overrides):
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    overrides = rewrite_overrides(overrides, PPO_TREE)
    fast = _outcome(lambda items: compose_with_hydra("ppo_trainer", CONFIG_DIR, items, cacheable=True), overrides)
    full = _outcome(lambda items: composition._compose_fully("ppo_trainer", CONFIG_DIR, items), overrides)
    assert fast == full
    assert fast[0] == "error" or (fast[2] is True and fast[3] is False)  # struct mode, no hydra node


def test_other_packaged_configs_compose_alike():
    for config_name, tree in (("grpo_smollm2_demo", PPO_TREE), ("sft_trainer", SFT_TREE)):
        store_schema(tree.schema_name, lambda tree=tree: schema_defaults(tree))
        fast = compose_with_hydra(config_name, CONFIG_DIR, ["trainer.total_epochs=2"], cacheable=True)
        full = composition._compose_fully(config_name, CONFIG_DIR, ["trainer.total_epochs=2"])
        assert OmegaConf.to_container(fast) == OmegaConf.to_container(full)
        assert fast.trainer.total_epochs == 2


def test_each_call_gets_its_own_copy():
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    first = compose_with_hydra("ppo_trainer", CONFIG_DIR, ["data.train_batch_size=8"], cacheable=True)
    with open_dict(first):
        first.data.train_batch_size = 99
        first.data.injected = 1
    second = compose_with_hydra("ppo_trainer", CONFIG_DIR, [], cacheable=True)
    assert second.data.train_batch_size != 99 and "injected" not in second.data


def test_an_edited_yaml_is_composed_again(tmp_path):
    directory = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, directory, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    yaml = directory / "grpo_smollm2_demo.yaml"
    before = compose_with_hydra("grpo_smollm2_demo", directory, [], cacheable=True)
    edited = OmegaConf.load(yaml)
    OmegaConf.update(edited, "trainer.project_name", "edited_project", force_add=True)
    OmegaConf.save(edited, yaml)
    stat = yaml.stat()
    os.utime(yaml, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new version even on a coarse clock
    after = compose_with_hydra("grpo_smollm2_demo", directory, [], cacheable=True)
    assert after.trainer.project_name == "edited_project" != before.trainer.project_name


def test_a_directory_with_config_groups_takes_hydras_whole_path(tmp_path):
    directory = tmp_path / "configs"
    (directory / "algorithm").mkdir(parents=True)
    (directory / "main.yaml").write_text("defaults:\n  - ppo_trainer_schema\n  - _self_\n")
    (directory / "algorithm" / "tight.yaml").write_text("# @package algorithm\ngamma: 0.5\n")
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    composed = compose_with_hydra("main", directory, ["+algorithm=tight"], cacheable=True)
    assert composed.algorithm.gamma == 0.5


def test_plain_overrides_reuse_one_composition_and_hydras_own_keys_do_not(monkeypatch):
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    compose_with_hydra("ppo_trainer", CONFIG_DIR, [], cacheable=True)  # cached from here on
    calls = []
    whole = composition._compose_fully
    monkeypatch.setattr(composition, "_compose_fully", lambda *args: calls.append(args) or whole(*args))
    for batch in (2, 4, 8):
        assert compose_with_hydra("ppo_trainer", CONFIG_DIR, [f"data.train_batch_size={batch}"],
                                  cacheable=True).data.train_batch_size == batch
    assert calls == []
    compose_with_hydra("ppo_trainer", CONFIG_DIR, ["hydra.job.name=x"], cacheable=True)
    compose_with_hydra("ppo_trainer", CONFIG_DIR, ["data.train_batch_size=2"], cacheable=False)
    assert len(calls) == 2


def test_a_directory_without_groups_is_cached_even_with_bytecode_beside_it(tmp_path, monkeypatch):
    directory = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, directory, ignore=shutil.ignore_patterns("*.py"))
    (directory / "__pycache__").mkdir(exist_ok=True)  # what Python writes beside the package's modules
    (directory / "__pycache__" / "loader.cpython-311.pyc").write_bytes(b"")
    store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    compose_with_hydra("ppo_trainer", directory, [], cacheable=True)
    calls = []
    whole = composition._compose_fully
    monkeypatch.setattr(composition, "_compose_fully", lambda *args: calls.append(args) or whole(*args))
    composed = compose_with_hydra("ppo_trainer", directory, ["trainer.total_epochs=3"], cacheable=True)
    assert composed.trainer.total_epochs == 3
    assert calls == []
