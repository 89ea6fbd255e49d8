"""`CriticWorker`: the value model used by GAE (token-level values from a causal-LM backbone + value head)."""

from __future__ import annotations

import time
from pathlib import Path

from hybridflow.engines.training import build_fsdp_engine
from hybridflow.engines.training.mesh import ParallelLayout
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.workers.config import HF_MODEL_DIR, CriticConfig, WorkerRuntimeConfig
from hybridflow.workers.efficiency import EfficiencyMeter
from hybridflow.workers.offload import optimizer_on_device
from hybridflow.workers.process import prepare_worker_process
from hybridflow.workers.ppo_update import make_critic_loss_fn, mean_metrics, run_update


CRITIC_MESH = "critic"
"""Dispatch mesh of the critic's compute methods: one data shard per data-parallel group."""


class CriticWorker(Worker):
    """Computes and trains values; one instance per rank."""

    def __init__(self, config: CriticConfig, rollout_n: int, runtime: WorkerRuntimeConfig) -> None:
        super().__init__()
        self.config, self.rollout_n, self.runtime = config, rollout_n, runtime
        self._update_count = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the backbone with a fresh value head (collective when sharded)."""
        critic, runtime = self.config, self.runtime
        model_path, self.tokenizer = prepare_worker_process(self, runtime, critic.model)
        engine_config = critic.engine_config(runtime.total_training_steps)
        self.engine = build_fsdp_engine(model_path, engine_config, model_kind="value", tokenizer=self.tokenizer)
        self.layout = ParallelLayout(
            self.world_size, critic.model.fsdp_config.tensor_parallel_size, critic.ulysses_sequence_parallel_size
        )
        self.register_dispatch_collect_info(
            CRITIC_MESH, self.layout.dp_rank(self.rank), self.layout.dp, self.layout.is_collect(self.rank)
        )
        self.efficiency = EfficiencyMeter(self.engine, self.layout)  # perf/mfu/critic and critic_infer

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(CRITIC_MESH))
    def compute_values(self, data: DataProto) -> DataProto:
        """`values` (bs, response_len): the value predicted for each response token."""
        start = time.perf_counter()
        values = self.engine.compute_values(
            data,
            micro_batch_size=self.config.forward_micro_batch_size_per_gpu,
            max_token_len=self.config.forward_token_budget,
        )
        metrics = self.efficiency.metrics("critic_infer", time.perf_counter() - start)
        return DataProto.from_dict({"values": values}, meta_info={"metrics": metrics})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(CRITIC_MESH))
    def update_critic(self, data: DataProto) -> DataProto:
        """PPO epochs of clipped value regression onto `returns`; `critic/*` metrics in meta_info. With
        model.fsdp_config.optimizer_offload the optimizer state is on the device only during the update."""
        start = time.perf_counter()
        with optimizer_on_device(self.engine, self.config.model.fsdp_config.optimizer_offload):
            metrics = run_update(
                self.engine,
                data,
                mini_batch_size_per_rank=self.config.ppo_mini_batch_size * self.rollout_n // self.layout.dp,
                micro_batch_size=self.config.ppo_micro_batch_size_per_gpu,
                max_token_len=self.config.update_token_budget,
                epochs=self.config.ppo_epochs,
                shuffle=self.config.shuffle,
                seed=self.runtime.seed + self._update_count,
                make_loss_fn=lambda counts: make_critic_loss_fn(self.config, counts),
                metric_prefix="critic",
            )
        self._update_count += 1
        result = mean_metrics(metrics)
        result["critic/lr"] = self.engine.lr_scheduler_step()
        result["timing_s/update_critic_worker"] = seconds = time.perf_counter() - start
        result.update(self.efficiency.metrics("critic", seconds))
        return DataProto.from_dict({}, meta_info={"metrics": result})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """The critic's `checkpoint.save_contents` (collective): sharded state, and with hf_model a full HF
        directory of the value model (`huggingface_full/`)."""
        contents = self.config.checkpoint
        self.engine.save_checkpoint(local_path, contents.engine_parts)
        if contents.saves_hf_model:
            self.engine.save_hf_model(str(Path(local_path) / HF_MODEL_DIR))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore the critic's `checkpoint.load_contents` from `save_checkpoint`'s directory."""
        self.engine.load_checkpoint(local_path, contents=self.config.checkpoint.resume_parts)
