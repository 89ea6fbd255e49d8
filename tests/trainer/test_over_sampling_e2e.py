"""GRPO with agent loops and over-sampling on 2 Ray workers (tiny model, native engine's continuous batching): the
stragglers of each step are aborted (agent loops: through the workers' control group; batch generation: in each
rank's engine), trained on nothing, and counted."""

from __future__ import annotations

import math

import pytest

from tests.tiny_runs import build_workspace
from tests.trainer.placement_runs import overrides, train


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("over_sampling"), train_size=8, test_size=2)


MODES = {
    # agent loops: over the batch's 16 trajectories on both replicas; 2 requests decode at once per replica, the
    # stragglers wait in the queue
    "async": ("actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.mode=async",
              "data.return_raw_chat=True", "actor_rollout_ref.rollout.agent.max_concurrent_requests_per_replica=2"),
    # batch generation: over each rank's 8 rows (native: 2 slots at a time; hf: one generate call)
    "sync_native": ("actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.max_num_seqs=2"),
    "sync_hf": ("actor_rollout_ref.rollout.name=hf",),
}


@pytest.mark.slow  # a Ray run; the server's abort, the manager and the control group are tested in every CI run
@pytest.mark.parametrize("mode", sorted(MODES))
def test_grpo_with_over_sampling_aborts_and_trains_on_the_rest(workspace, ray_cluster, mode):
    records, _ = train(overrides(
        workspace, workspace / f"over_sampled_{mode}", "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.over_sample_rate=0.25", *MODES[mode],
    ))
    assert sorted(records) == [1, 2]
    for step, record in records.items():
        # 16 trajectories a step: after 12 have ended the rest are aborted (some may have ended meanwhile)
        assert 0.0 <= record["response/aborted_ratio"] <= 0.25, (step, record["response/aborted_ratio"])
        for key in ("actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert math.isfinite(record[key]), (step, key, record[key])
    if mode != "sync_hf":  # hf decodes a rank's rows in lock-step: the tiny model's rows all end at the 12-token
        # limit together, so there is nothing to cut (its cut is tested in tests/engines/rollout/test_server_abort.py)
        assert any(record["response/aborted_ratio"] > 0 for record in records.values()), "no step aborted anything"
