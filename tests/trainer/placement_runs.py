"""Runs shared by the placement, off-policy, parallel, PRIME and vision tests: a tiny workspace, the overrides of a
2-step GRPO run on 2 trainer ranks, and `train` (the trainer as `run_ppo` builds it, with the actor's and rollout's weight
digests before and after); `tests.helpers.grpo_overrides` is the valid command line for config checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.plot import metrics_by_step
from tests.tiny_runs import build_workspace, workspace_overrides


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("placement"), train_size=8, test_size=2)


def overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """GRPO with a KL loss (so the trainer pool hosts actor and reference), 2 steps, 2 trainer ranks."""
    return [
        *workspace_overrides(root, run_dir, validate=False),
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        "trainer.num_threads_per_worker=1",  # same float reductions in every process, whatever the pool sizes
        "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
        "trainer.logger=[file]",
        *extra,
    ]


SPLIT = ("actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=2")


def train(args: list[str], trainer_cls: type | None = None) -> tuple[dict[int, dict], list[tuple[dict, list[dict]]]]:
    """Train as `run_ppo` does (with `trainer_cls`, default `RayPPOTrainer`); per-step metrics, and (actor digests,
    rollout ranks' digests) before and after."""
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer
    from hybridflow.trainer.run import build_dataloaders, build_reward_manager
    from hybridflow.trainer.scaffold import build_processor, build_tokenizer, build_tracking

    config = load_config(args)
    validate_config(config)
    tokenizer = build_tokenizer(config.actor_rollout_ref.model)
    processor = build_processor(config.actor_rollout_ref.model, tokenizer)  # None for text models
    train_loader, _ = build_dataloaders(config.data, tokenizer, processor)
    reward_fn = build_reward_manager(config.reward_model, config.custom_reward_function, config.data, tokenizer)
    tracking = build_tracking(config.trainer, config)
    trainer = (trainer_cls or RayPPOTrainer)(config, train_loader, None, reward_fn, reward_fn, tracking)
    digests = []
    try:
        trainer.init_workers()
        digests.append(weight_digests(trainer))
        trainer.fit()
        digests.append(weight_digests(trainer))
    finally:
        if trainer.workers is not None:
            trainer.workers.shutdown()
        reward_fn.close()
        tracking.finish()
    return metrics_by_step(config.trainer.default_local_dir), digests


def weight_digests(trainer) -> tuple[dict, list[dict]]:
    """The actor's full weights (rank 0's answer) and each rollout rank's, as sha256 per tensor."""
    workers = trainer.workers
    actor = workers.actor_rollout.weight_digests()[0]
    return actor, workers.rollout.weight_digests() if workers.rollout is not None else []


# ----------------------------------------------------------------------------- config (no Ray)
@pytest.fixture()
def train_file(tmp_path):
    from tests.helpers import write_rows

    return write_rows(tmp_path / "train.parquet", ["gsm8k"] * 16)


ONE_PLUS_ONE = ("actor_rollout_ref.hybrid_engine=False", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1")
