"""The hybrid controller in two minutes: one driver loop, two worker groups, DataProto in between.

A "policy" group (2 ranks, one gloo process group) proposes numbers; a "judge" group scores them;
the policy moves its shared mean toward high-scoring proposals with an all-reduce. The driver only
writes the algorithm; `@register` says how each batch is split across ranks and merged back.

Run: python examples/hybrid_controller_demo.py
"""

from __future__ import annotations

import ray
import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

TARGET = 3.0


class PolicyWorker(Worker):
    """Holds a 1-parameter 'policy' (a Gaussian mean), replicated on every rank."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed()  # gloo on CPU, nccl on GPU
        self.mean = torch.zeros(1)
        self.generator = torch.Generator().manual_seed(self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate(self, prompts: DataProto) -> DataProto:
        samples = self.mean + torch.randn(len(prompts), generator=self.generator)
        return DataProto.from_dict({"sample": samples})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update(self, batch: DataProto) -> DataProto:
        weights = torch.softmax(batch.batch["score"] * 4, dim=0)
        step = ((batch.batch["sample"] - self.mean) * weights).sum().reshape(1)
        dist.all_reduce(step)  # average the update over data-parallel ranks
        self.mean += step / self.world_size
        return DataProto.from_dict({}, meta_info={"metrics": {"policy/mean": self.mean.item()}})


class JudgeWorker(Worker):
    """Scores samples by closeness to a target the policy does not know."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"score": -(batch.batch["sample"] - TARGET).abs()})


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    policy = RayWorkerGroup(RayResourcePool([2], num_cpus_per_worker=0.5), RayClassWithInitArgs(PolicyWorker))
    judge = RayWorkerGroup(RayResourcePool([2], num_cpus_per_worker=0.5), RayClassWithInitArgs(JudgeWorker))
    policy.init_model()
    prompts = DataProto.from_dict({"prompt_id": torch.arange(64)})
    for step in range(10):  # the algorithm, as a plain loop on the driver
        batch = policy.generate(prompts)
        batch = batch.union(judge.score(batch))
        metrics = policy.update(batch).meta_info["metrics"]
        print(f"step {step}: mean score {batch.batch['score'].mean():+.3f}  policy mean {metrics['policy/mean'][0]:.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
