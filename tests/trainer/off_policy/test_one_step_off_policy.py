"""One-step off-policy on split pools: batch k+1 is generated with the weights from before update k, so every sample
after the first batch is exactly one policy version stale, and says so."""

from __future__ import annotations

import pytest

from hybridflow.trainer.checkpointing import load_driver_state
from hybridflow.trainer.config import load_config
from hybridflow.trainer.off_policy.main_one_step_off import main as one_step_main
from hybridflow.trainer.off_policy.checks import check_one_step_off_policy
from hybridflow.trainer.off_policy.one_step_off_policy import OneStepOffPolicyTrainer
from tests.helpers import grpo_overrides
from tests.tiny_runs import start_from_checkpoint
from tests.trainer.placement_runs import SPLIT, overrides, train, train_file, workspace  # noqa: F401


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_samples_after_the_first_batch_are_one_version_stale(workspace, ray_cluster):  # noqa: F811
    args = (*SPLIT, "trainer.total_training_steps=3", "trainer.total_epochs=2",
            "algorithm.rollout_correction.rollout_is=token")  # importance weights against the stale rollout
    records, digests = train(overrides(workspace, workspace / "one_step", *args, "trainer.save_freq=2"),
                             OneStepOffPolicyTrainer)
    assert sorted(records) == [1, 2, 3]
    for step, staleness in ((1, 0), (2, 1), (3, 1)):
        record = records[step]
        assert record["rollout/staleness/min"] == record["rollout/staleness/max"] == staleness, (step, record)
        assert record["sync_rollout_weights/policy_version"] == step and record["actor/grad_norm"] > 0
    # The rollout's own log-probs show which weights sampled: the first batch's match the policy it is trained
    # from; later batches come from the policy one update older.
    # (Here 5e-11 against 1e-5: the tiny model's updates move its log-probs a little.)
    on_policy = records[1]["training/rollout_probs_diff_max"]
    for step in (2, 3):
        stale = records[step]["training/rollout_probs_diff_max"]
        assert stale > max(1e-7, 100 * on_policy), (step, on_policy, stale)
        assert records[step]["rollout_corr/rollout_is_max"] > 1 or records[step]["rollout_corr/rollout_is_min"] < 1
    (_, _), (actor_end, rollout_end) = digests
    assert all(rank == actor_end for rank in rollout_end), "the last sync leaves the rollout equal to the trainer"

    # The step-2 checkpoint holds the data position before batch 3 (in flight when it was written: drawn, so the
    # sampler itself is already past it): the end of epoch 0's 2 batches. A resumed run trains on batch 3,
    # generated again with the restored weights (staleness 0).
    sampler = load_driver_state(workspace / "one_step" / "global_step_2")["sampler"]
    assert (sampler["epoch"], sampler["position"]) == (0, 8), sampler
    resumed_dir = start_from_checkpoint(workspace / "one_step" / "global_step_2", workspace / "one_step_resumed")
    resumed, _ = train(overrides(workspace, resumed_dir, *args), OneStepOffPolicyTrainer)
    assert sorted(resumed) == [3] and resumed[3]["rollout/staleness/max"] == 0
    assert resumed[3]["prompt_length/mean"] == records[3]["prompt_length/mean"]


@pytest.mark.parametrize(("extra", "words"), [
    ((), ["actor_rollout_ref.hybrid_engine=False"]),
    (SPLIT + ("algorithm.filter_groups.enable=True",), ["algorithm.filter_groups.enable=True", "hybridflow train"]),
    (SPLIT + ("actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True",
              "actor_rollout_ref.rollout.multi_turn.enable=True"), ["rollout.mode=async with multi-turn generation"]),
])
def test_what_one_step_off_policy_needs_is_checked(train_file, extra, words):  # noqa: F811
    with pytest.raises(ValueError) as info:
        check_one_step_off_policy(load_config(grpo_overrides(train_file, *extra)))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_cli_refuses_colocated_placement(train_file, capsys):  # noqa: F811
    assert one_step_main(["--dry-run", *grpo_overrides(train_file)]) == 2
    assert "hybrid_engine=False" in capsys.readouterr().err
    assert one_step_main(["--dry-run", *grpo_overrides(train_file, *SPLIT)]) == 0
    assert "[placement] split" in capsys.readouterr().out


def test_verl_s_rollout_mode_async_runs_single_turn_rows_by_batch_generation(train_file, capsys):  # noqa: F811
    """verl's off-policy trainers assert rollout.mode=async (its default); single-turn lines run here, in sync."""
    from hybridflow.trainer.off_policy.main_fully_async import main as fully_async_main

    line = grpo_overrides(train_file, *SPLIT, "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True")
    for main in (one_step_main, fully_async_main):
        assert main(["--dry-run", *line]) == 0
        assert "mode: sync" in capsys.readouterr().out
        assert main(["--dry-run", *line, "actor_rollout_ref.rollout.multi_turn.enable=True"]) == 2
        assert "rollout.mode=async with multi-turn generation" in capsys.readouterr().err


def test_verl_s_one_step_off_config_name_is_packaged(train_file, capsys):  # noqa: F811
    """verl's scripts run `--config-path=config --config-name=one_step_off_ppo_trainer.yaml` (its recipe's YAML)."""
    args = ["--config-path=config", "--config-name=one_step_off_ppo_trainer.yaml",
            *grpo_overrides(train_file, "rollout.n_gpus_per_node=2")]
    assert one_step_main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert "[placement] split" in out and "bypass_mode: true" in out


def test_the_heartbeat_skips_the_rollout_pool_while_it_generates():
    """A ping to a rollout worker busy with the next batch would queue behind the generation and time out."""
    from types import SimpleNamespace

    from hybridflow.trainer.worker_setup import WorkerGroups

    trainer_pool, rollout_pool = SimpleNamespace(name="hybridflow_trainer_pool"), SimpleNamespace(name="hybridflow_rollout_pool")
    trainer = OneStepOffPolicyTrainer.__new__(OneStepOffPolicyTrainer)
    trainer.workers = WorkerGroups(actor_rollout=None, critic=None, processes=[trainer_pool, rollout_pool])
    trainer._in_flight = None
    assert trainer.idle_processes() == [trainer_pool, rollout_pool]
    trainer._in_flight = object()
    assert trainer.idle_processes() == [trainer_pool]
