"""The end-to-end GRPO/PPO runs of test_e2e.py, shared with the guard, chaos and LoRA tests: a tiny workspace, the
overrides of a 2-rank run, and `run` (the `run_ppo` path of `hybridflow train`) with its per-step metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.run import run_ppo
from tests.tiny_runs import build_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, ray_cluster):
    return build_workspace(tmp_path_factory.mktemp("e2e"), train_size=16, test_size=4)


def overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        f"data.val_files=[{root / 'data' / 'test.parquet'}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={root / 'tiny'}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={run_dir}",
        f"custom_reward_function.path={root / 'reward.py'}",
        *extra,
    ]


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
    metrics_file = Path(config.trainer.default_local_dir) / "metrics.jsonl"
    return [json.loads(line) for line in metrics_file.read_text().splitlines()]


def by_step(records: list[dict]) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return merged
