"""Placement from config: colocated (default) vs split (the rollout on its own pool, weights synced after each
actor update over a group spanning both pools), on local Ray with 2 CPU processes per pool and a tiny model."""

from __future__ import annotations


import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.main_ppo import main as train_main
from tests.helpers import grpo_overrides
from tests.tiny_runs import start_from_checkpoint
from tests.trainer.placement_runs import SPLIT, overrides, train, train_file, workspace  # noqa: F401  (fixtures)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_split_placement_matches_colocated_and_syncs_weights_bitwise(workspace, ray_cluster):
    colocated, _ = train(overrides(workspace, workspace / "colocated"))
    # 1 MiB buckets: the embedding (12.6 MB) goes alone, the small tensors share buckets
    bucketed = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1"
    split, digests = train(overrides(workspace, workspace / "split", *SPLIT, "trainer.save_freq=1", bucketed))

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
        assert 1 < split[step]["sync_rollout_weights/num_buckets"] < len(actor_start)  # fewer collectives than tensors

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


@pytest.mark.parametrize(("extra", "words"), [
    (("rollout.n_gpus_per_node=2",),
     ["rollout.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=True", "hybrid_engine=False"]),
    (("actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=0"), ["rollout.nnodes=0", "> 0"]),
    (("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",),
     ["update_weights_bucket_megabytes=512", "hybrid_engine=True", "no transfer to bucket"]),
    (("actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=2",
      "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0"),
     ["update_weights_bucket_megabytes", "> 0"]),
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
        validate_config(load_config(grpo_overrides(train_file, *extra)))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_dry_run_prints_the_placement(train_file, tmp_path, capsys):
    assert train_main(["--dry-run", *grpo_overrides(train_file)]) == 0
    out = capsys.readouterr().out
    assert "[placement] colocated" in out and "global_pool  2 processes (1 node x 2)  actor, rollout" in out
    split = ["actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=2", "rollout.n_gpus_per_node=3",
             "actor_rollout_ref.actor.use_kl_loss=True"]
    assert train_main(["--dry-run", *grpo_overrides(train_file, *split)]) == 0
    out = capsys.readouterr().out
    assert "[placement] split" in out
    assert "trainer_pool  2 processes (1 node x 2)   actor, ref" in out
    assert "rollout_pool  6 processes (2 nodes x 3)  rollout" in out
    from hybridflow.models import save_tiny_reward_model

    save_tiny_reward_model(tmp_path / "rm", num_layers=1, hidden=64, seed=0)
    own_rm = ["reward_model.enable=True", f"reward_model.model.path={tmp_path / 'rm'}",
              "reward_model.enable_resource_pool=True", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=3"]
    assert train_main(["--dry-run", *grpo_overrides(train_file, *own_rm)]) == 0
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
