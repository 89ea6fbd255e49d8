"""rollout.dtype on one CPU rank: 'auto' generates with the actor's own module; a dtype set explicitly gets the
rollout its own copy in that dtype, which the weight hand-over refreshes before each generation (as on more ranks,
and as fp32 master weights on an accelerator)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.engines.training import OptimConfig
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig
from tests.workers.test_optimizer_offload import RUNTIME, local_group, model_dir, ppo_batch  # noqa: F401 (fixture)


def _prompts(batch: DataProto) -> DataProto:
    prompt_length = batch.batch["input_ids"].size(1) - batch.batch["responses"].size(1)
    tensors = {key: batch.batch[key][:, :prompt_length] for key in ("input_ids", "attention_mask", "position_ids")}
    return DataProto.from_dict(tensors=tensors)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_set_rollout_dtype_is_honoured_on_one_cpu_rank(model_dir, dtype):  # noqa: F811
    from hybridflow.workers import ActorRolloutRefWorker

    actor = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2))
    rollout = RolloutConfig(name="hf", dtype=dtype, response_length=4, prompt_length=16, do_sample=False)
    config = ActorRolloutRefConfig(model=ModelConfig(path=model_dir), actor=actor, rollout=rollout)
    group, worker = local_group(ActorRolloutRefWorker, config, "actor_rollout", RUNTIME)
    if worker.actor_engine.device.type != "cpu":
        pytest.skip("the rule for CPU ranks")
    batch = ppo_batch(model_dir)
    group.generate_sequences(_prompts(batch))
    served = next(worker.rollout.model.parameters())
    expected = torch.float32 if dtype == "auto" else torch.bfloat16
    assert served.dtype == expected
    assert worker._rollout_shares_module is (dtype == "auto")
    group.update_actor(batch)
    group.generate_sequences(_prompts(batch))  # the hand-over brings the update to the copy
    trained = dict(worker.actor_engine.module.named_parameters())
    for name, param in worker.rollout.model.named_parameters():
        torch.testing.assert_close(param, trained[name].detach().to(param.dtype), rtol=0, atol=0, msg=name)
