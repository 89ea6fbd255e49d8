"""Where old log-probs come from: a separate pass, the update's own forward (exactly on-policy), or the rollout
(bypass mode). The first update is the same in all three; off-policy updates without them are refused."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms import compute_rollout_probs_diff
from hybridflow.engines.rollout import RolloutConfig
from hybridflow.engines.training import OptimConfig
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller.base.worker_group import WorkerError
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, WorkerRuntimeConfig

PROMPT_LEN, RESPONSE_LEN, BATCH = 8, 6, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, hidden=64, seed=0))


def worker(model_dir: str, ppo_mini_batch_size: int = BATCH, micro_batch_size: int = 2) -> LocalWorkerGroup:
    config = ActorRolloutRefConfig(
        model=ModelConfig(path=model_dir),
        actor=ActorConfig(
            ppo_mini_batch_size=ppo_mini_batch_size, ppo_micro_batch_size_per_gpu=micro_batch_size,
            optim=OptimConfig(lr=1e-2)
        ),
        rollout=RolloutConfig(name="native", temperature=0.9, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN),
    )
    group = LocalWorkerGroup(
        RayClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout", WorkerRuntimeConfig(seed=0, num_threads=1))
    )
    group.init_model()
    return group


def rollout(group: LocalWorkerGroup) -> DataProto:
    ids = torch.randint(5, 200, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    torch.manual_seed(0)
    batch = group.generate_sequences(prompts)
    batch.meta_info = {}
    batch.batch["advantages"] = torch.linspace(-1, 1, BATCH)[:, None].expand(-1, RESPONSE_LEN).contiguous()
    return batch


def update(group: LocalWorkerGroup, batch: DataProto) -> dict[str, float]:
    return {key: values[0] for key, values in group.update_actor(batch).meta_info["metrics"].items()}


def without(batch: DataProto, key: str) -> DataProto:
    copy = DataProto.from_dict({k: v.clone() for k, v in batch.batch.items() if k != key}, meta_info={})
    return copy


def test_the_first_update_is_the_same_from_every_source(model_dir):
    full, on_policy, bypass = worker(model_dir), worker(model_dir), worker(model_dir)
    batch = rollout(full)
    old = full.compute_log_prob(batch)
    recomputed = without(batch, "old_log_probs").union(DataProto.from_dict({"old_log_probs": old.batch["old_log_probs"]}))
    by_pass = without(batch, "old_log_probs")
    by_pass.batch["old_log_probs"] = by_pass.batch["rollout_log_probs"].clone()

    a = update(full, recomputed)
    b = update(on_policy, without(batch, "old_log_probs"))
    c = update(bypass, by_pass)
    assert a["actor/grad_norm"] > 0
    assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-6 and abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 1e-5
    # The native engine's log-probs match the trainer's to ~1e-4, so bypass mode moves the ratio by that much.
    assert abs(a["actor/pg_loss"] - c["actor/pg_loss"]) < 1e-3 and abs(a["actor/grad_norm"] - c["actor/grad_norm"]) < 1e-3
    # The on-policy path still reports entropy and the rollout-vs-trainer gap, from the update's own forward.
    assert b["actor/entropy"] > 0 and b["training/rollout_probs_diff_max"] < 1e-3
    expected = compute_rollout_probs_diff(batch.batch["rollout_log_probs"], old.batch["old_log_probs"],
                                          batch.batch["response_mask"])
    assert abs(b["training/rollout_probs_diff_mean"] - expected["training/rollout_probs_diff_mean"]) < 1e-6
    for name, value in full.workers[0].actor_engine.named_full_params():
        assert torch.allclose(value, dict(on_policy.workers[0].actor_engine.named_full_params())[name], atol=1e-5), name


def test_the_logged_policy_loss_does_not_depend_on_the_micro_batch_size(model_dir):
    """Each micro-batch's pg_loss is its share of the mini-batch's (normalised by the mini-batch's tokens): the
    logged value is their sum, the mini-batch's loss, whatever the micro-batch size (it used to be their mean)."""
    metrics = {}
    for micro in (1, 4):
        group = worker(model_dir, micro_batch_size=micro)
        batch = rollout(group)
        batch.batch["old_log_probs"] = group.compute_log_prob(batch).batch["old_log_probs"]
        batch.batch["advantages"] = batch.batch["advantages"] + 0.5  # a mean that is not 0: a loss that is not 0
        metrics[micro] = update(group, batch)
    assert metrics[1]["actor/pg_loss"] == pytest.approx(metrics[4]["actor/pg_loss"], abs=1e-6)
    assert metrics[1]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/loss"], abs=1e-6)  # no entropy or KL term
    assert abs(metrics[1]["actor/pg_loss"]) > 1e-3


def test_an_off_policy_update_without_old_log_probs_is_refused(model_dir):
    group = worker(model_dir, ppo_mini_batch_size=2)  # two optimizer steps per update
    with pytest.raises(WorkerError, match="ValueError: update_actor got no old_log_probs.*several optimizer steps"):
        group.update_actor(without(rollout(group), "old_log_probs"))


def test_rollout_probs_diff_by_hand():
    rollout_lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    actor_lp = torch.log(torch.tensor([[0.4, 0.2, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])
    metrics = compute_rollout_probs_diff(rollout_lp, actor_lp, mask)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.05)
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert compute_rollout_probs_diff(rollout_lp, actor_lp, torch.zeros_like(mask)) == {
        "training/rollout_probs_diff_valid": 0.0
    }
