"""PRIME's implicit PRM worker: zero rewards while it equals its reference, and online updates that order each
prompt's samples as their outcomes do."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms.prime import prime_dpo_accuracy
from hybridflow.engines.training import OptimConfig
from hybridflow.models import load_tokenizer, save_tiny_model
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.workers import PrimeRewardModelWorker
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig
from hybridflow.trainer.scaffold import worker_metrics
from tests.engines.helpers import make_batch


def test_implicit_prm_starts_at_zero_and_learns_the_outcomes(tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "tiny", seed=0))
    model = RewardModelModelConfig(path=model_dir, update="before", beta_train=0.5, optim=OptimConfig(lr=1e-2))
    config = RewardModelWorkerConfig(enable=True, model=model, micro_batch_size_per_gpu=2)
    group = LocalWorkerGroup(RayClassWithInitArgs(PrimeRewardModelWorker, config, WorkerRuntimeConfig(seed=0)))
    group.init_model()

    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=8, seed=5)
    batch.batch["acc"] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    index = np.array([f"p{i // 4}" for i in range(8)], dtype=object)
    mask = batch.batch["response_mask"]

    q = group.compute_rm_score(batch).batch["prime_q"]
    assert torch.equal(q, torch.zeros_like(q)), "the implicit PRM starts as its reference: no reward"

    losses = [worker_metrics(group.update_rm(batch))["reward_model/prime_loss"] for _ in range(6)]
    assert abs(losses[0] - np.log(2.0)) < 1e-5  # sigmoid(0) against 0/1 labels
    assert losses[-1] < 0.5 * losses[0], losses
    q = group.compute_rm_score(batch).batch["prime_q"]
    assert (q[mask == 0] == 0).all()
    assert prime_dpo_accuracy(q, batch.batch["acc"], mask, index) == 1.0
