"""`PrimeRewardModelWorker`: PRIME's implicit process reward model, a causal LM trained online from outcomes.

It holds two engines: the implicit PRM (trained) and its frozen reference. `compute_rm_score` returns
`prime_q` = log pi_prm - log pi_ref per response token; `update_rm` takes one optimizer step of the cross-entropy
between sigmoid(beta * sum q) and each sample's outcome label `acc`. The driver turns q into token rewards
(`algorithms.prime`), so the batch-level normalisation sees the whole batch.
"""

from __future__ import annotations

import time

import torch

from hybridflow.algorithms.prime import prime_ce_loss
from hybridflow.engines.training import build_fsdp_engine
from hybridflow.models import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.offload import optimizer_on_device
from hybridflow.workers.reward_config import RewardModelWorkerConfig
from hybridflow.workers.process import prepare_worker_process

PRIME_MESH = "prime_rm"
"""Dispatch mesh of the implicit PRM's methods: one data shard per data-parallel group."""


class PrimeRewardModelWorker(Worker):
    """One rank of the implicit PRM (and its reference); methods are called on the whole group."""

    def __init__(self, config: RewardModelWorkerConfig, runtime: WorkerRuntimeConfig) -> None:
        super().__init__()
        self.config, self.runtime = config, runtime
        self._update_count = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the implicit PRM with its optimizer and the frozen reference (collective when sharded)."""
        config, runtime, model = self.config, self.runtime, self.config.model
        model_path, self.tokenizer = prepare_worker_process(self, runtime, model)
        prm_config, ref_config = config.prime_engine_configs(runtime.total_training_steps)
        self.prm = build_fsdp_engine(model_path, prm_config, tokenizer=self.tokenizer)
        ref_path = resolve_model_path(model.ref_path) if model.ref_path is not None else model_path
        self.ref = build_fsdp_engine(ref_path, ref_config, tokenizer=self.tokenizer)
        layout = self.prm.layout
        self.register_dispatch_collect_info(PRIME_MESH, layout.dp_rank(self.rank), layout.dp, layout.is_collect(self.rank))

    def _log_probs(self, engine, data: DataProto) -> torch.Tensor:
        log_probs, _ = engine.compute_log_prob(
            data, micro_batch_size=self.config.micro_batch_size_per_gpu or len(data),
            max_token_len=self.config.forward_token_budget,
        )
        return log_probs

    def _ref_log_probs(self, data: DataProto) -> torch.Tensor:
        """The reference's log-probs: the batch's `prime_ref_log_probs` when the driver fetched them already."""
        if "prime_ref_log_probs" in data.batch.keys():
            return data.batch["prime_ref_log_probs"]
        return self._log_probs(self.ref, data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(PRIME_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`prime_ref_log_probs` (bs, response_len) under the frozen reference: computed once per batch, then
        passed to `update_rm` and `compute_rm_score`."""
        start = time.perf_counter()
        log_probs = self._log_probs(self.ref, data)
        return DataProto.from_dict(
            {"prime_ref_log_probs": log_probs}, meta_info={"metrics": {"timing_s/prime_rm_ref": time.perf_counter() - start}}
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(PRIME_MESH))
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`prime_q` (bs, response_len): log pi_prm - log pi_ref of each response token, 0 elsewhere."""
        start = time.perf_counter()
        mask = data.batch["response_mask"].to(torch.float32)
        q = (self._log_probs(self.prm, data) - self._ref_log_probs(data)) * mask
        return DataProto.from_dict({"prime_q": q}, meta_info={"metrics": {"timing_s/prime_rm_score": time.perf_counter() - start}})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(PRIME_MESH))
    def update_rm(self, data: DataProto) -> DataProto:
        """One optimizer step of the implicit PRM on this batch's outcomes (`acc`, (bs,) in [0, 1]). With
        reward_model.model.fsdp_config.optimizer_offload its optimizer state is on the device only during the step."""
        start = time.perf_counter()
        ref_log_probs = self._ref_log_probs(data)
        data = DataProto.from_dict(
            {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses",
                                              "response_mask", "acc")}
        )
        data.batch["prime_ref_log_probs"] = ref_log_probs
        beta = self.config.model.beta_train

        def loss_fn(outputs: dict[str, torch.Tensor], micro_batch) -> tuple[torch.Tensor, dict[str, float]]:
            batch = micro_batch.batch if isinstance(micro_batch, DataProto) else micro_batch
            mask = batch["response_mask"].to(outputs["log_probs"].dtype)
            q = (outputs["log_probs"] - batch["prime_ref_log_probs"]) * mask
            loss = prime_ce_loss(q, batch["acc"], mask, beta)
            return loss, {"prime_loss": float(loss.detach())}

        self.prm.module.train()
        micro_batches, _ = self.prm.split_micro_batches(
            data, self.config.micro_batch_size_per_gpu or len(data), self.config.forward_token_budget
        )
        with optimizer_on_device(self.prm, self.config.model.fsdp_config.optimizer_offload):
            result = self.prm.train_batch(micro_batches, loss_fn)  # the loss is a mean over rows: weighted by rows
        lr = self.prm.lr_scheduler_step()
        self._update_count += 1
        metrics = {
            "reward_model/prime_loss": result["prime_loss"],
            "reward_model/grad_norm": result["grad_norm"],
            "reward_model/lr": lr,
            "timing_s/prime_rm_update": time.perf_counter() - start,
        }
        return DataProto.from_dict({}, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """The implicit PRM's sharded weights, optimizer and schedule (collective); the reference is frozen."""
        self.prm.save_checkpoint(local_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        self.prm.load_checkpoint(local_path)
