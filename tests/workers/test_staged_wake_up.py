"""rollout.multi_stage_wake_up: the rollout wakes its weights, takes the actor's weights, and only then its KV cache,
so the hand-over's transient tensors and the cache never take memory together; without it the cache is back
before the hand-over."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.models import save_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from tests.models.test_lora import lora_worker_args


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "whole"])
def test_the_kv_cache_wakes_after_the_hand_over_when_staged(tmp_path, staged):
    model_dir = str(save_tiny_model(tmp_path / "tiny", seed=0))
    cls, config, role, runtime = lora_worker_args(model_dir, rollout_name="native")
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, lora_rank=0),
        rollout=dataclasses.replace(config.rollout, multi_stage_wake_up=staged),
    )
    group = LocalWorkerGroup(RayClassWithInitArgs(cls, config, role, runtime), world_size=1)
    group.init_model()
    worker = group.workers[0]
    rollout = worker.rollout
    ids = torch.randint(5, 400, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    group.generate_sequences(prompts)  # reserves the cache, then sleeps (free_cache_engine)
    assert not rollout.cache.allocated
    seen = []
    original = rollout.update_weights

    def recording(named_tensors):
        seen.append(rollout.cache.allocated)
        return original(named_tensors)

    rollout.update_weights = recording
    worker._rollout_weights_stale = True  # as after an update
    worker._wake_up_with_weights()
    assert seen == [not staged], "the cache was asleep during the hand-over only when staged"
    assert rollout.cache.allocated, "and awake once the hand-over is done"
