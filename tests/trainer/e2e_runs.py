"""The end-to-end GRPO/PPO runs of test_e2e.py, shared with the guard, chaos and LoRA tests: a tiny workspace, the
overrides of a 2-rank run, and `run` (the `run_ppo` path of `hybridflow train`) with its per-step metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.plot import merge_by_step as by_step  # noqa: F401  (the tests' name for it)
from hybridflow.trainer.plot import read_metrics
from hybridflow.trainer.run import run_ppo
from tests.tiny_runs import build_workspace, workspace_overrides


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, ray_cluster):
    return build_workspace(tmp_path_factory.mktemp("e2e"), train_size=16, test_size=4)


def overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """The workspace's run on 2 ranks, validated, logged to the console and the metrics file."""
    return [*workspace_overrides(root, run_dir), "trainer.n_gpus_per_node=2", "trainer.logger=[console,file]", *extra]


GRPO = (
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "trainer.total_training_steps=3",
    "trainer.save_freq=2",
    "trainer.test_freq=3",  # validates at step 3 (and before training); -1 would validate before training only
)


def run(args: list[str]) -> list[dict]:
    config = load_config(args)
    run_ppo(config, validate_config(config))
    return read_metrics(config.trainer.default_local_dir)
