"""`SFTWorker`: one rank of supervised fine-tuning on the FSDP2 engine (full weights or LoRA).

The driver calls every method on the whole group: `train_step` / `eval_loss` take a batch of right-padded
samples (`input_ids`, `attention_mask`, `position_ids`, `loss_mask`: (bs, seq)) split across ranks by
`Dispatch.DP_COMPUTE_PROTO`. The loss is the mean negative log-likelihood over every loss-masked token of the
whole batch on all ranks, so it does not depend on the micro-batch size or the number of ranks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.workers.config import HF_MODEL_DIR, CheckpointConfig, WorkerRuntimeConfig
from hybridflow.workers.offload import optimizer_on_device
from hybridflow.workers.ppo_update import compute_global_counts
from hybridflow.workers.process import prepare_worker_process


SFT_MESH = "sft"
"""Dispatch mesh of the SFT steps: one data shard per data-parallel group (tensor/sequence-parallel peers share it)."""


def with_targets(data: DataProto) -> DataProto:
    """Add `responses` = input_ids[:, 1:]: the engine then returns the log-prob of every token after the first."""
    data.batch["responses"] = data.batch["input_ids"][:, 1:]
    return data


def sft_loss_fn(num_tokens: float, dp_size: int):
    """`loss_fn(outputs, micro_batch)`: summed masked NLL / global token count x dp_size (FSDP averages ranks)."""

    def loss_fn(outputs: dict[str, torch.Tensor], micro_batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch.batch["loss_mask"][:, 1:].to(outputs["log_probs"].dtype)
        loss = -(outputs["log_probs"] * mask).sum() / num_tokens * dp_size
        return loss, {}

    return loss_fn


class SFTWorker(Worker):
    """One data-parallel rank of SFT."""

    def __init__(self, engine_config: FSDPEngineConfig, runtime: WorkerRuntimeConfig,
                 checkpoint: CheckpointConfig = CheckpointConfig(), token_budget: int | None = None) -> None:
        """token_budget: tokens per micro-batch (data.use_dynamic_bsz), or None for micro_batch_size_per_gpu rows."""
        super().__init__()
        self.engine_config, self.runtime, self.checkpoint = engine_config, runtime, checkpoint
        self.token_budget = token_budget
        self.engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the model (LoRA-wrapped if configured) and its optimizer (collective with several ranks)."""
        runtime, model = self.runtime, self.engine_config.model
        model_path, self.tokenizer = prepare_worker_process(self, runtime, model)
        self.engine = build_fsdp_engine(model_path, self.engine_config, tokenizer=self.tokenizer)
        layout = self.engine.layout
        self.register_dispatch_collect_info(SFT_MESH, layout.dp_rank(self.rank), layout.dp, layout.is_collect(self.rank))

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(SFT_MESH))
    def train_step(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's share; metrics `train/loss`, `train/grad_norm`, `train/lr`. With
        model.fsdp_config.optimizer_offload the optimizer state is on the device only during the step."""
        start = time.perf_counter()
        data = with_targets(data)
        counts = compute_global_counts(data.batch["loss_mask"][:, 1:], self.engine.device)
        batch = data if self.token_budget is None else self.engine.split_micro_batches(
            data, max_token_len=self.token_budget)[0]
        with optimizer_on_device(self.engine, self.engine_config.fsdp.optimizer_offload):
            result = self.engine.train_batch(batch, sft_loss_fn(counts.num_tokens, counts.dp_size), scale_by_rows=False)
        self.engine.lr_scheduler_step()
        metrics = {
            "train/loss": result["loss"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/num_skipped_steps": result["num_skipped_steps"],
            "timing_s/train_step_worker": time.perf_counter() - start,
        }
        return DataProto.from_dict({}, meta_info={"metrics": metrics})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(SFT_MESH))
    def eval_loss(self, data: DataProto) -> DataProto:
        """Per sample: `nll_sum` (summed NLL of its loss-masked tokens) and `num_tokens` (both (bs,) float)."""
        data = with_targets(data)
        log_probs, _ = self.engine.compute_log_prob(data, max_token_len=self.token_budget)
        mask = data.batch["loss_mask"][:, 1:].to(log_probs.dtype)
        return DataProto.from_dict({"nll_sum": -(log_probs * mask).sum(-1), "num_tokens": mask.sum(-1)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """`checkpoint.save_contents` into `local_path`: model/optimizer shards, scheduler and RNG (and
        `lora_adapter/` for LoRA), and with hf_model a full HF directory (`huggingface_full/`)."""
        self.engine.save_checkpoint(local_path, self.checkpoint.engine_parts)
        if self.checkpoint.saves_hf_model:
            self.engine.save_hf_model(str(Path(local_path) / HF_MODEL_DIR), self.tokenizer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore `checkpoint.load_contents` of what `save_checkpoint` wrote (same world size)."""
        self.engine.load_checkpoint(local_path, contents=self.checkpoint.resume_parts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_pid_and_rss(self) -> tuple[int, int]:
        """(pid, peak resident set size in bytes) of this worker's process."""
        import resource

        return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
