"""ActorRolloutRefWorker with a tensor-parallel native rollout (2 Ray ranks, one replica): both ranks get the same
prompts, one output comes back, greedy tokens equal one process's, and after an update the hand-over gives the
rollout the actor's new weights."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import NativeRollout, RolloutConfig, SamplingParams
from hybridflow.engines.training import OptimConfig
from hybridflow.models import build_causal_lm, load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, WorkerRuntimeConfig
from tests.workers.rollout_batches import BATCH, PROMPT_LEN, RESPONSE_LEN, masked_max_diff, prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models import build_tiny_model
    from hybridflow.models.loader import save_model_and_tokenizer

    model, tokenizer = build_tiny_model("llama", initializer_range=0.3, seed=1)  # peaked: varied greedy tokens
    return str(save_model_and_tokenizer(model, tokenizer, tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def group(ray_cluster, model_dir):
    config = ActorRolloutRefConfig(
        model=ModelConfig(path=model_dir),
        actor=ActorConfig(ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=1, optim=OptimConfig(lr=1e-2)),
        rollout=RolloutConfig(
            name="native", tensor_model_parallel_size=2, temperature=0.8, prompt_length=PROMPT_LEN,
            response_length=RESPONSE_LEN,
        ),
    )
    pool = RayResourcePool([2])
    runtime = WorkerRuntimeConfig(seed=0, num_threads=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout", runtime))
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.release()


def test_tp_peers_share_prompts_and_one_output_comes_back(group, model_dir):
    assert group.query_dispatch_info("rollout") == [(0, 1, True), (0, 1, False)]
    greedy = prompts()
    greedy.meta_info["validate"] = True  # the validation sampling: greedy
    out = group.generate_sequences(greedy)
    assert len(out) == BATCH and len(out.meta_info["metrics"]["timing_s/update_weights"]) == 1
    tokenizer = load_tokenizer(model_dir)
    single = NativeRollout(build_causal_lm(model_dir), tokenizer, SamplingParams(max_new_tokens=RESPONSE_LEN))
    expected = single.generate_sequences(greedy)
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    assert len(set(out.batch["responses"].flatten().tolist())) > 4


def test_update_then_handover_reshards_the_new_weights(group):
    batch = group.generate_sequences(prompts())
    batch.meta_info = {}
    mask = batch.batch["response_mask"].float()
    old = group.compute_log_prob(batch)
    assert masked_max_diff(old.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask) < 1e-4
    old.meta_info = {}
    batch = batch.union(old)
    batch.batch["advantages"] = torch.linspace(-1, 1, BATCH)[:, None].expand(-1, RESPONSE_LEN).contiguous()
    assert group.update_actor(batch).meta_info["metrics"]["actor/grad_norm"][0] > 0
    second = group.generate_sequences(prompts())
    assert second.meta_info["metrics"]["timing_s/update_weights"][0] > 0
    second.meta_info = {}
    new_mask = second.batch["response_mask"].float()
    new_old = group.compute_log_prob(second)
    assert masked_max_diff(new_old.batch["old_log_probs"], second.batch["rollout_log_probs"], new_mask) < 1e-4
