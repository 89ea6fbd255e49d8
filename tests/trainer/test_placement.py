"""Placement from config: colocated (default) vs split (the rollout on its own pool, weights synced after each
actor update over a group spanning both pools), on local Ray with 2 CPU processes per pool and a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.main_ppo import main as train_main
from tests.tiny_runs import build_workspace, start_from_checkpoint

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("placement"), train_size=8, test_size=2)


def overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """GRPO with a KL loss (so the trainer pool hosts actor and reference), 2 steps, 2 trainer ranks."""
    return [
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={root / 'tiny'}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        "trainer.num_threads_per_worker=1",  # same float reductions in every process, whatever the pool sizes
        "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={run_dir}",
        f"custom_reward_function.path={root / 'reward.py'}",
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
    records: dict[int, dict] = {}
    for line in (Path(config.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records, digests


def weight_digests(trainer) -> tuple[dict, list[dict]]:
    """The actor's full weights (rank 0's answer) and each rollout rank's, as sha256 per tensor."""
    workers = trainer.workers
    actor = workers.actor_rollout.weight_digests()[0]
    return actor, workers.rollout.weight_digests() if workers.rollout is not None else []


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_split_placement_matches_colocated_and_syncs_weights_bitwise(workspace, ray_cluster):
    colocated, _ = train(overrides(workspace, workspace / "colocated"))
    split, digests = train(overrides(workspace, workspace / "split", *SPLIT, "trainer.save_freq=1"))

    # The weight sync leaves every rollout rank bitwise equal to the trainer, at start and after the updates.
    (actor_start, rollout_start), (actor_end, rollout_end) = digests
    assert len(rollout_start) == len(rollout_end) == 2 and len(actor_start) > 0
    assert all(rank == actor_start for rank in rollout_start)
    assert all(rank == actor_end for rank in rollout_end)
    assert actor_end != actor_start, "the updates changed the weights, so the sync had something to carry"

    # Same seed, same first-step rollout (initial weights): the same numbers, and (bitwise-equal weights, the same
    # per-rank sampling seed and policy version) the same second step too.
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
            "actor/entropy", "critic/advantages/max")
    for step in (1, 2):
        for key in keys:
            assert split[step][key] == colocated[step][key], f"step {step} {key}: {split[step][key]} vs {colocated[step][key]}"
        assert split[step]["timing_s/sync_rollout_weights"] > 0 and "timing_s/sync_rollout_weights" not in colocated[step]
        assert split[step]["sync_rollout_weights/policy_version"] == step
        assert split[step]["sync_rollout_weights/size_mb"] > 0

    # Resuming from step 1 loads the actor and syncs the rollout to it: step 2 reproduces the uninterrupted run.
    resumed_dir = start_from_checkpoint(workspace / "split" / "global_step_1", workspace / "split_resumed")
    resumed, _ = train(overrides(workspace, resumed_dir, *SPLIT))
    assert sorted(resumed) == [2]
    for key in keys:
        assert resumed[2][key] == split[2][key], f"{key}: resumed {resumed[2][key]} vs uninterrupted {split[2][key]}"


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_reward_model_on_its_own_pool_scores_as_it_does_colocated(workspace, ray_cluster):
    """The reward model's own pool (1 process) scores the same samples as the reward model in the actor's 2
    processes: the same step metrics, the same rm score."""
    from hybridflow.models import save_tiny_reward_model

    rm_dir = workspace / "tiny_rm"
    if not rm_dir.exists():
        save_tiny_reward_model(rm_dir, num_layers=2, hidden=64, seed=5)
    rm = ("reward_model.enable=True", f"reward_model.model.path={rm_dir}", "reward_model.rule_reward_coef=1.0",
          "trainer.total_training_steps=1")
    colocated, _ = train(overrides(workspace, workspace / "rm_colocated", *rm))
    own_pool, _ = train(overrides(
        workspace, workspace / "rm_own_pool", *rm, "reward_model.enable_resource_pool=True", "reward_model.nnodes=1",
        "reward_model.n_gpus_per_node=1",
    ))
    for key in ("reward/rm_score/mean", "critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        assert own_pool[1][key] == pytest.approx(colocated[1][key], rel=1e-5, abs=1e-6), key
    assert own_pool[1]["reward/rm_score/mean"] != 0


# ----------------------------------------------------------------------------- config (no Ray)
@pytest.fixture()
def train_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"data_source": ["gsm8k"] * 16}), path)
    return str(path)


def good(train_file: str, *extra: str) -> list[str]:
    return [
        f"data.train_files=[{train_file}]", "data.train_batch_size=8", "data.max_prompt_length=64",
        "data.max_response_length=32", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=2", *extra,
    ]


@pytest.mark.parametrize(("extra", "words"), [
    (("rollout.n_gpus_per_node=2",),
     ["rollout.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=True", "hybrid_engine=False"]),
    (("actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=0"), ["rollout.nnodes=0", "> 0"]),
    (("actor_rollout_ref.hybrid_engine=False", "rollout.n_gpus_per_node=-1"), ["rollout.n_gpus_per_node=-1", "> 0"]),
    (("actor_rollout_ref.hybrid_engine=False", "trainer.n_gpus_per_node=1", "trainer.local_mode=True"),
     ["actor_rollout_ref.hybrid_engine=False", "trainer.local_mode=True"]),
    (("reward_model.enable=True", "reward_model.enable_resource_pool=True"),
     ["reward_model.enable_resource_pool", "reward_model.nnodes=0", "set both > 0"]),
    (("reward_model.enable_resource_pool=True", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"),
     ["reward_model.enable_resource_pool", "set reward_model.enable=True"]),
    (("reward_model.enable=True", "reward_model.n_gpus_per_node=2"),
     ["reward_model.enable_resource_pool", "set reward_model.enable_resource_pool=True or drop the sizes"]),
    (("reward_model.enable=True", "reward_model.enable_resource_pool=True", "reward_model.nnodes=1",
      "reward_model.n_gpus_per_node=1", "trainer.local_mode=True", "trainer.n_gpus_per_node=1"),
     ["reward_model.enable_resource_pool=True", "trainer.local_mode=True"]),
])
def test_placement_keys_are_checked(train_file, extra, words):
    with pytest.raises(ValueError) as info:
        validate_config(load_config(good(train_file, *extra)))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_dry_run_prints_the_placement(train_file, tmp_path, capsys):
    assert train_main(["--dry-run", *good(train_file)]) == 0
    out = capsys.readouterr().out
    assert "[placement] colocated" in out and "global_pool  2 processes (1 node x 2)  actor, rollout" in out
    split = ["actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=2", "rollout.n_gpus_per_node=3",
             "actor_rollout_ref.actor.use_kl_loss=True"]
    assert train_main(["--dry-run", *good(train_file, *split)]) == 0
    out = capsys.readouterr().out
    assert "[placement] split" in out
    assert "trainer_pool  2 processes (1 node x 2)   actor, ref" in out
    assert "rollout_pool  6 processes (2 nodes x 3)  rollout" in out
    from hybridflow.models import save_tiny_reward_model

    save_tiny_reward_model(tmp_path / "rm", num_layers=1, hidden=64, seed=0)
    own_rm = ["reward_model.enable=True", f"reward_model.model.path={tmp_path / 'rm'}",
              "reward_model.enable_resource_pool=True", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=3"]
    assert train_main(["--dry-run", *good(train_file, *own_rm)]) == 0
    out = capsys.readouterr().out
    assert "global_pool  2 processes (1 node x 2)  actor, rollout" in out
    assert "reward_pool  3 processes (1 node x 3)  reward_model" in out


def test_group_calls_run_together_and_the_first_failure_raises_at_once():
    """A sync's two sides must run at the same time; if one fails, the driver must not wait on the other."""
    import threading
    import time

    from hybridflow.trainer.worker_setup import run_together

    both = threading.Barrier(2, timeout=5)
    assert run_together(lambda: (both.wait(), "sent")[1], lambda: (both.wait(), "received")[1]) == ["sent", "received"]

    stuck = threading.Event()  # a receiver whose sender died: it would wait until its process is killed

    def fail():
        raise RuntimeError("worker rank 0 failed in 'send_rollout_weights'")

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="send_rollout_weights"):
        run_together(fail, lambda: stuck.wait(30))
    assert time.perf_counter() - start < 5
    stuck.set()
