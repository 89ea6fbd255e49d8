"""The fully async trainer under a deterministic schedule (1 trainer + 1 rollout process, tiny model, no threads):
a partially rolled-out sample holds tokens of two policy versions, its staleness counts its oldest token and rollout
correction weighs each token against the weights that sampled it; a seeded schedule reproduces a run exactly; with
staleness 0 the run is the synchronous trainer's."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.trainer.off_policy.schedule import AsyncSchedule
from hybridflow.trainer.config import load_config
from hybridflow.trainer.off_policy.checks import check_fully_async
from hybridflow.trainer.off_policy.fully_async_policy import FullyAsyncTrainer
from tests.helpers import grpo_overrides
from tests.trainer.placement_runs import ONE_PLUS_ONE, SPLIT, overrides, train, train_file, workspace  # noqa: F401

PARTIAL = ("async_training.partial_rollout=True", "async_training.partial_rollout_chunk_tokens=4",
           "async_training.staleness_threshold=1", "async_training.deterministic_schedule_seed=0")
"""Responses of 12 tokens (data.max_response_length) in 3 chunks of 4; seeds the schedule (tests may script it)."""
STEPS = ("trainer.total_training_steps=3", "trainer.total_epochs=2")


class ScriptedTrainer(FullyAsyncTrainer):
    """Replays `events` (None: the seeded schedule) and keeps each step's trained batch and each chunk's versions."""

    events: list[str] | None = None
    trained: dict[int, dict[str, torch.Tensor]] = {}
    chunks: list[tuple[int, int, int]] = []  # (step of the batch, chunk index, param version)
    history: list[str] = []

    def build_schedule(self, seed):
        type(self).history = []
        return AsyncSchedule(seed=seed) if self.events is None else AsyncSchedule(events=self.events)

    def build_rollouter(self, batches):
        rollouter = super().build_rollouter(batches)
        generate_chunk = rollouter.generate_chunk

        def generate_recorded(generation):  # under the weights of the gate's current version
            type(self).chunks.append((generation.step, generation.rollout.num_chunks, self.gate.param_version))
            generate_chunk(generation)

        rollouter.generate_chunk = generate_recorded
        return rollouter

    def train_step(self, batches, metrics, timing):
        batch = super().train_step(batches, metrics, timing)
        keys = ("token_param_versions", "token_policy_versions", "staleness", "rollout_param_version",
                "response_mask", "old_log_probs", "rollout_log_probs", "rollout_is_weights")
        present = batch.batch.keys()
        type(self).trained[self.global_steps] = {key: batch.batch[key].clone() for key in keys if key in present}
        type(self).history = list(self.rollouter.schedule.history)
        return batch


def run(workspace, name: str, *extra: str, events=None):  # noqa: F811
    ScriptedTrainer.events, ScriptedTrainer.trained, ScriptedTrainer.chunks = events, {}, []
    records, _ = train(overrides(workspace, workspace / name, *ONE_PLUS_ONE, *STEPS, *extra), ScriptedTrainer)
    return records, dict(ScriptedTrainer.trained), list(ScriptedTrainer.chunks), list(ScriptedTrainer.history)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_a_partial_sample_spans_two_versions_counts_its_oldest_token_and_is_corrected(workspace, ray_cluster):  # noqa
    # Batch 1 in 3 chunks (v0); batch 2's first chunk (v0); step 1 trains and syncs (v1); batch 2's last two chunks
    # (v1); step 2 trains batch 2 (v1 -> v2); step 3 generates batch 3 (v2) and trains it.
    events = ["generate"] * 4 + ["train", "generate", "generate", "train", "train"]
    records, trained, chunks, _ = run(
        workspace, "scripted", *PARTIAL, "algorithm.rollout_correction.rollout_is=token", events=events
    )
    assert chunks == [(1, 0, 0), (1, 1, 0), (1, 2, 0), (2, 0, 0), (2, 1, 1), (2, 2, 1), (3, 0, 2), (3, 1, 2),
                      (3, 2, 2)]
    batch = trained[2]
    mask = batch["response_mask"].bool()
    assert mask.sum(1).min() > 4, "every response of batch 2 goes past its first chunk"
    expected = torch.where(torch.arange(12) < 4, 0, 1).expand_as(mask)
    assert torch.equal(batch["token_param_versions"], torch.where(mask, expected, -1))  # exact per token
    assert torch.equal(batch["token_policy_versions"], torch.where(mask, expected, -1))  # 1 update per sync here
    # The staleness of a sample is its oldest token's: trained at v1, first tokens from v0.
    assert batch["rollout_param_version"].tolist() == [0] * 8 and batch["staleness"].tolist() == [1] * 8
    step2 = records[2]
    assert step2["rollout/staleness/max"] == step2["rollout/staleness/min"] == 1
    assert step2["fully_async/partial/partial_ratio"] == 1.0 and step2["fully_async/partial/max_partial_span"] == 1
    num_old = 4 * 8
    assert step2["fully_async/token_staleness/mean"] == pytest.approx(num_old / mask.sum().item())
    assert step2["fully_async/token_staleness/max"] == 1
    for step in (1, 3):
        assert records[step]["rollout/staleness/max"] == 0 and records[step]["fully_async/partial/partial_ratio"] == 0
    # Correction: the trainer's old log-probs are v1's (one update). Tokens sampled by v1 carry v1's rollout
    # log-probs (weight 1 up to engine parity); tokens sampled by v0 carry v0's, so their weights move off 1.
    weights, log_ratio = batch["rollout_is_weights"], batch["old_log_probs"] - batch["rollout_log_probs"]
    new, old = mask & (expected == 1), mask & (expected == 0)
    assert log_ratio[new].abs().max() < 1e-4
    assert log_ratio[old].abs().mean() > 10 * log_ratio[new].abs().mean()
    threshold = 2.0  # algorithm.rollout_correction.rollout_is_threshold's default
    torch.testing.assert_close(weights[mask], log_ratio[mask].exp().clamp(max=threshold))
    assert weights[new].sub(1).abs().max() < 1e-4 and weights[old].sub(1).abs().max() > 1e-3
    # verl's rollout_corr metrics are computed on the mixed batch
    assert step2["rollout_corr/rollout_is_mean"] == pytest.approx(float(log_ratio[mask].exp().mean()), rel=1e-5)
    assert math.isfinite(step2["actor/pg_loss"])


def deterministic(record: dict) -> dict:
    """The metrics that measure neither time nor process memory (the guards' `memory/*`)."""
    return {key: value for key, value in record.items()
            if not key.startswith(("perf/", "memory/")) and not key.endswith("_s") and "timing" not in key
            and "time" not in key}


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_a_seeded_schedule_reproduces_a_run(workspace, ray_cluster):  # noqa: F811
    seeded = (*PARTIAL, "async_training.deterministic_schedule_seed=1")  # seed 1 pauses a batch across a sync
    first, _, chunks_1, history_1 = run(workspace, "seeded_1", *seeded)
    second, _, chunks_2, history_2 = run(workspace, "seeded_2", *seeded)
    assert history_1 == history_2 and chunks_1 == chunks_2
    assert "generate" in history_1[history_1.index("train"):], "the rollouter generated while the trainer trained"
    assert sorted(first) == sorted(second) == [1, 2, 3]
    for step in (1, 2, 3):
        assert deterministic(first[step]) == deterministic(second[step]), step
    assert max(first[step]["fully_async/partial/partial_ratio"] for step in (1, 2, 3)) > 0, "seed 1 pauses a batch"


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_staleness_0_is_the_synchronous_run(workspace, ray_cluster):  # noqa: F811
    sync, _ = train(overrides(workspace, workspace / "sync", *ONE_PLUS_ONE, *STEPS))
    scheduled, _, chunks, _ = run(
        workspace, "stale0", "async_training.staleness_threshold=0", "async_training.deterministic_schedule_seed=0"
    )
    assert chunks == [(1, 0, 0), (2, 0, 1), (3, 0, 2)]  # each batch in one call, after the previous step's sync
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")
    for step in (1, 2, 3):
        assert scheduled[step]["rollout/staleness/max"] == 0
        for key in keys:
            assert scheduled[step][key] == sync[step][key], (step, key, scheduled[step][key], sync[step][key])


# ----------------------------------------------------------------------------- config (no Ray)
def test_partial_rollout_chunks_must_be_shorter_than_a_response(train_file):  # noqa: F811
    cfg = load_config(grpo_overrides(train_file, *SPLIT, "async_training.partial_rollout=True",
                           "async_training.partial_rollout_chunk_tokens=32"))
    with pytest.raises(ValueError) as info:
        check_fully_async(cfg)
    for word in ("async_training.partial_rollout_chunk_tokens=32", "response_length=32", "partial_rollout=False"):
        assert word in str(info.value)
    check_fully_async(load_config(grpo_overrides(train_file, *SPLIT, "async_training.partial_rollout=True",
                                       "async_training.partial_rollout_chunk_tokens=8")))
    with pytest.raises(ValueError, match="partial_rollout_chunk_tokens=0"):
        load_config(grpo_overrides(train_file, *SPLIT, "async_training.partial_rollout_chunk_tokens=0"))
