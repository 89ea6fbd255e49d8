"""The fully async trainer on split pools (1 trainer + 1 rollout process, tiny model): its staleness bound, the
policy versions its samples carry, its weight-sync schedule, and with threshold 0 a synchronous run."""

from __future__ import annotations

import pytest
import torch

from hybridflow.trainer.config import load_config
from hybridflow.trainer.off_policy.checks import check_fully_async
from hybridflow.trainer.off_policy.fully_async_policy import FullyAsyncTrainer
from hybridflow.trainer.off_policy.rollouter import ThreadedRollouter, syncs_before
from hybridflow.trainer.off_policy.main_fully_async import main as fully_async_main
from hybridflow.trainer.main_ppo import main as train_main
from tests.helpers import grpo_overrides
from tests.tiny_runs import start_from_checkpoint
from tests.trainer.placement_runs import (  # noqa: F401  (train_file and workspace are fixtures)
    ONE_PLUS_ONE, SPLIT, overrides, train, train_file, workspace,
)


class RecordingTrainer(FullyAsyncTrainer):
    """Keeps each step's per-sample version columns."""

    columns: dict[int, dict[str, list[int]]] = {}

    def sample(self, batches, metrics, timing):
        batch = super().sample(batches, metrics, timing)
        keys = ("rollout_param_version", "rollout_policy_version", "staleness")
        type(self).columns[self.global_steps] = {key: batch.batch[key].tolist() for key in keys}
        versions, mask = batch.batch["token_param_versions"], batch.batch["response_mask"].bool()
        oldest = torch.where(mask, versions, versions.max() + 1).min(dim=1).values
        assert torch.equal(oldest, batch.batch["rollout_param_version"]), "a sample's version is its oldest token's"
        return batch


@pytest.mark.slow  # two runs; the fully async trainer runs end to end in `make test-all` (test below too)
def test_threshold_0_is_synchronous(workspace, ray_cluster):  # noqa: F811
    args = (*ONE_PLUS_ONE, "trainer.total_training_steps=3", "trainer.total_epochs=2")
    sync, _ = train(overrides(workspace, workspace / "sync", *args))
    fully_async, digests = train(
        overrides(workspace, workspace / "async0", *args, "async_training.staleness_threshold=0"), FullyAsyncTrainer
    )
    assert sorted(fully_async) == [1, 2, 3]
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")
    for step in (1, 2, 3):
        record = fully_async[step]
        assert record["rollout/staleness/max"] == record["rollout/staleness/min"] == 0, (step, record)
        assert record["fully_async/param_version"] == step - 1
        assert record["sync_rollout_weights/policy_version"] == step
        assert record["fully_async/num_dropped_samples"] == 0
        for key in keys:  # the same samples, generated after the previous step's sync, as the synchronous trainer's
            assert record[key] == sync[step][key], f"step {step} {key}: {record[key]} vs {sync[step][key]}"
    (_, _), (actor_end, rollout_end) = digests
    assert all(rank == actor_end for rank in rollout_end), "the last sync leaves the rollout equal to the trainer"


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_staleness_bound_versions_and_sync_schedule(workspace, ray_cluster):  # noqa: F811
    """The real threads, with partial rollout: syncs pause the rollouter between chunks."""
    args = (*ONE_PLUS_ONE, "trainer.total_training_steps=5", "trainer.total_epochs=3",
            "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2",
            "async_training.partial_rollout=True", "async_training.partial_rollout_chunk_tokens=4",
            "algorithm.rollout_correction.rollout_is=token")
    RecordingTrainer.columns = {}
    records, digests = train(overrides(workspace, workspace / "async1", *args, "trainer.save_freq=4"), RecordingTrainer)
    assert sorted(records) == [1, 2, 3, 4, 5]
    for step, record in records.items():
        param_version = syncs_before(step, 0, 2)  # syncs after steps 2 and 4
        assert record["fully_async/param_version"] == param_version
        assert 0 <= record["rollout/staleness/min"] <= record["rollout/staleness/max"] <= 1, (step, record)
        assert record["fully_async/queue_size"] <= 4 and record["fully_async/num_dropped_samples"] == 0
        # Syncs exactly every 2 steps, and after the last; the version synced is the actor's update count.
        synced = step % 2 == 0 or step == 5
        assert ("sync_rollout_weights/policy_version" in record) == synced, (step, record)
        if synced:
            assert record["sync_rollout_weights/policy_version"] == step
        columns = RecordingTrainer.columns[step]
        for version, policy, staleness in zip(*columns.values()):
            assert staleness == param_version - version and 0 <= staleness <= 1
            assert policy == 2 * version  # a param version is 2 updates
    (_, _), (actor_end, rollout_end) = digests
    assert all(rank == actor_end for rank in rollout_end)

    # The step-4 checkpoint holds the data position before batch 5 (drawn or not when it was written): a resumed
    # run trains on the same prompts, generated with the restored weights (staleness 0).
    resumed_dir = start_from_checkpoint(workspace / "async1" / "global_step_4", workspace / "async1_resumed")
    resumed, _ = train(overrides(workspace, resumed_dir, *args), FullyAsyncTrainer)
    assert sorted(resumed) == [5] and resumed[5]["rollout/staleness/max"] == 0
    assert resumed[5]["prompt_length/mean"] == records[5]["prompt_length/mean"]
    assert resumed[5]["sync_rollout_weights/policy_version"] == 5


def test_a_rollouter_error_ends_the_step():
    """The trainer thread raises what the rollouter thread hit, instead of waiting for samples forever."""
    rollouter = ThreadedRollouter(None, None, None, last_step=1, capacity=1)
    rollouter.error = ConnectionError("rollout rank 1 died")
    with pytest.raises(RuntimeError, match="rollouter") as info:
        rollouter.take()
    assert isinstance(info.value.__cause__, ConnectionError)


def test_a_fractional_threshold_leads_by_whole_batches():
    """verl's bound, (1 + staleness) x sync window, in whole steps' batches; the staleness it allows."""
    from hybridflow.trainer.off_policy.rollouter import VersionGate

    assert [(g.lead, g.max_staleness) for g in (VersionGate(0.1, 4), VersionGate(0.5, 4), VersionGate(1, 4),
                                               VersionGate(0.5, 1), VersionGate(0, 2))] == [
        (4, 0), (6, 1), (8, 1), (1, 0), (2, 0)]
    gate = VersionGate(0.5, 4)
    assert [step for step in range(1, 12) if gate.is_open(step)] == [1, 2, 3, 4, 5, 6]  # before the first sync
    gate.param_version = 1  # synced after step 4
    assert max(step for step in range(1, 20) if gate.is_open(step)) == 10
    # whole thresholds keep the old rule: syncs_before(step) - param_version <= threshold
    whole = VersionGate(1, 2)
    for version in range(3):
        whole.param_version = version
        assert all(whole.is_open(step) == (syncs_before(step, 0, 2) - version <= 1) for step in range(1, 12))


def test_syncs_before():
    # sync every 2 steps from the start: steps 1-2 see 0 syncs, 3-4 one, 5 two
    assert [syncs_before(step, 0, 2) for step in range(1, 6)] == [0, 0, 1, 1, 2]
    # resumed after step 3 (sync after 4): step 4 sees none, 5 and 6 one
    assert [syncs_before(step, 3, 2) for step in range(4, 7)] == [0, 1, 1]
    assert [syncs_before(step, 0, 1) for step in range(1, 4)] == [0, 1, 2]


# ----------------------------------------------------------------------------- config (no Ray)
@pytest.mark.parametrize(("extra", "words"), [
    ((), ["actor_rollout_ref.hybrid_engine=False"]),
    (SPLIT + ("algorithm.filter_groups.enable=True",), ["algorithm.filter_groups.enable=True", "hybridflow train"]),
    (SPLIT + ("actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True",
              "actor_rollout_ref.rollout.multi_turn.enable=True"), ["rollout.mode=async with multi-turn generation"]),
    (SPLIT + ("trainer.critic_warmup=1",), ["trainer.critic_warmup=1", "set it to 0"]),
    (SPLIT + ("actor_rollout_ref.rollout.over_sample_rate=0.1", "async_training.partial_rollout=True",
              "async_training.staleness_threshold=1", "async_training.partial_rollout_chunk_tokens=4"),
     ["over_sample_rate=0.1 with async_training.partial_rollout=True", "the next chunk continues"]),
])
def test_what_the_fully_async_trainer_needs_is_checked(train_file, extra, words):  # noqa: F811
    with pytest.raises(ValueError) as info:
        check_fully_async(load_config(grpo_overrides(train_file, *extra)))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.parametrize(("extra", "words"), [
    (("async_training.partial_rollout_chunk_tokens=-4",), ["async_training.partial_rollout_chunk_tokens=-4", "> 0"]),
    (("async_training.require_batches=0",), ["async_training.require_batches=0", "> 0"]),
    (("async_training.staleness_threshold=-1",), ["async_training.staleness_threshold=-1"]),
    (("async_training.trigger_parameter_sync_step=0",), ["async_training.trigger_parameter_sync_step=0"]),
])
def test_async_training_values_are_checked(train_file, extra, words):  # noqa: F811
    with pytest.raises(ValueError) as info:
        load_config(grpo_overrides(train_file, *SPLIT, *extra))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_verl_s_fully_async_line_maps_onto_steps(train_file, capsys):  # noqa: F811
    """verl's tests/special_e2e/run_fully_async_policy.sh keys: train_batch_size=0 and require_batches size a step,
    gen_batch_size (verl's streaming unit) is dropped, rollout.total_rollout_steps / test_freq become trainer keys."""
    verl_keys = ("data.train_batch_size=0", "data.gen_batch_size=1", "async_training.require_batches=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "rollout.total_rollout_steps=40", "rollout.test_freq=3",
                 "rollout.total_epochs=5", "async_training.staleness_threshold=0.5",
                 "async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.rollout.mode=async")
    assert fully_async_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, *verl_keys)]) == 0
    out = capsys.readouterr().out
    for line in ("train_batch_size: 8", "gen_batch_size: null", "total_training_steps: 5", "test_freq: 6",
                 "total_epochs: 5", "staleness_threshold: 0.5", "require_batches: 2"):
        assert line in out, line
    # verl's docs: total_rollout_steps counts prompts (one a rollout step, its config's gen_batch_size: 1)
    assert fully_async_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, "rollout.total_rollout_steps=24")]) == 0
    assert "total_training_steps: 3" in capsys.readouterr().out  # 24 prompts over steps of data.train_batch_size=8
    assert fully_async_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, "data.train_batch_size=16",
                                                          "async_training.require_batches=2")]) == 2
    assert "data.train_batch_size=16 but async_training.require_batches=2" in capsys.readouterr().err
    assert train_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, "rollout.total_rollout_steps=40")]) == 2
    assert "rollout.total_rollout_steps=40 is verl's fully async rollouter's key" in capsys.readouterr().err


def test_cli_checks_before_ray(train_file, capsys):  # noqa: F811
    assert fully_async_main(["--dry-run", *grpo_overrides(train_file)]) == 2
    assert "hybrid_engine=False" in capsys.readouterr().err
    assert fully_async_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, "async_training.staleness_threshold=2")]) == 0
    assert "[placement] split" in capsys.readouterr().out
    # Other trainers do not read async_training.*: they refuse it rather than ignore it.
    assert train_main(["--dry-run", *grpo_overrides(train_file, *SPLIT, "async_training.staleness_threshold=2")]) == 2
    assert "train-fully-async" in capsys.readouterr().err
