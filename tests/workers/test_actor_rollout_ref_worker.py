"""ActorRolloutRefWorker through Ray with 2 ranks: generate -> log-probs -> update -> hand-over -> generate."""

from __future__ import annotations

import pytest
import torch

from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.engines.rollout import RolloutConfig
from hybridflow.engines.training import OptimConfig
from hybridflow.models.config import ModelConfig
from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, WorkerRuntimeConfig
from tests.workers.rollout_batches import BATCH, PROMPT_LEN, RESPONSE_LEN, masked_max_diff, prompts


@pytest.fixture(scope="module")
def group(ray_cluster, tmp_path_factory):
    from hybridflow.models import save_tiny_model

    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, hidden=64, seed=0)
    config = ActorRolloutRefConfig(
        model=ModelConfig(path=str(model_dir)),
        actor=ActorConfig(
            ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=1, optim=OptimConfig(lr=1e-2), use_kl_loss=True
        ),
        rollout=RolloutConfig(temperature=0.8, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN),
    )
    runtime = WorkerRuntimeConfig(seed=0, num_threads=1)
    pool = RayResourcePool([2])
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout_ref", runtime))
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.release()


def test_generate_logprob_update_and_weight_handover(group):
    batch = group.generate_sequences(prompts())
    assert batch.batch["responses"].shape == (BATCH, RESPONSE_LEN)
    assert batch.batch["input_ids"].shape == (BATCH, PROMPT_LEN + RESPONSE_LEN)
    mask = batch.batch["response_mask"].float()
    assert mask[:, 0].all(), "every response has at least one token"
    batch.meta_info = {}

    # Training engine and rollout agree on the sampled tokens' log-probs (same weights, the rollout config's
    # temperature on both sides: nothing is passed along with the batch).
    old = group.compute_log_prob(batch)
    assert masked_max_diff(old.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask) < 1e-4
    entropy = old.meta_info["metrics"]["actor/entropy"]
    assert len(entropy) == 2 and all(value > 0 for value in entropy)
    ref = group.compute_ref_log_prob(batch)
    assert masked_max_diff(ref.batch["ref_log_prob"], old.batch["old_log_probs"], mask) < 1e-6

    old.meta_info = {}
    batch = batch.union(old).union(ref)
    batch.batch["advantages"] = torch.linspace(-1, 1, BATCH)[:, None].expand(-1, RESPONSE_LEN).contiguous()
    metrics = group.update_actor(batch).meta_info["metrics"]
    assert len(metrics["actor/grad_norm"]) == 2 and metrics["actor/grad_norm"][0] > 0
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/lr"):
        assert key in metrics, key

    # The next generation first receives the updated weights from the FSDP shards (hand-over is timed)...
    second = group.generate_sequences(prompts())
    assert min(second.meta_info["metrics"]["timing_s/update_weights"]) > 0
    for key in ("timing_s/rollout_wake_up", "timing_s/rollout_sleep"):
        assert len(second.meta_info["metrics"][key]) == 2 and min(second.meta_info["metrics"][key]) >= 0, key
    # Every sample carries the version of the weights that sampled it: the initial ones, then the one update's.
    assert batch.batch["rollout_weight_version"].tolist() == [0] * BATCH
    assert second.batch["rollout_weight_version"].tolist() == [1] * BATCH
    second.meta_info = {}
    # ...so the rollout's log-probs match the updated actor, which no longer matches the reference.
    new_old = group.compute_log_prob(second)
    new_mask = second.batch["response_mask"].float()
    assert masked_max_diff(new_old.batch["old_log_probs"], second.batch["rollout_log_probs"], new_mask) < 1e-4
    new_ref = group.compute_ref_log_prob(second)
    assert masked_max_diff(new_ref.batch["ref_log_prob"], new_old.batch["old_log_probs"], new_mask) > 1e-3


def test_ranks_sample_differently_from_the_same_prompt(group):
    """Copies of one prompt on two ranks (n above the rows per rank) must not get the same responses."""
    same = prompts()[[1, 1]]
    assert torch.equal(same.batch["input_ids"][0], same.batch["input_ids"][1])
    out = group.generate_sequences(same)
    assert not torch.equal(out.batch["responses"][0], out.batch["responses"][1])
