"""`SFTWorker`: one rank of supervised fine-tuning on the FSDP2 engine (full weights or LoRA).

The driver calls every method on the whole group: `train_step` / `eval_loss` take a batch of right-padded
samples (`input_ids`, `attention_mask`, `position_ids`, `loss_mask`: (bs, seq)) split across ranks by
`Dispatch.DP_COMPUTE_PROTO`. The loss is the mean negative log-likelihood over every loss-masked token of the
whole batch on all ranks, so it does not depend on the micro-batch size or the number of ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from hybridflow.engines.training import build_fsdp_engine
from hybridflow.engines.training.config import FSDPEngineConfig, OptimConfig
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.trainer.sft.config import SFTConfig
from hybridflow.workers.ppo_update import compute_global_counts


@dataclass(frozen=True, kw_only=True)
class SFTRuntime:
    """What the driver derives for its workers."""

    total_training_steps: int
    """Length of the learning-rate schedule in steps."""
    num_threads: int = 0
    """torch intra-op threads of this worker; 0 leaves torch's default."""


def build_sft_engine_config(cfg: SFTConfig, total_training_steps: int) -> FSDPEngineConfig:
    """The training engine's config from the SFT config (verl's SFT optimizer keys mapped onto the engine's)."""
    optim, model, fsdp = cfg.optim, cfg.model, cfg.model.fsdp_config
    return FSDPEngineConfig(
        optim=OptimConfig(
            lr=optim.lr,
            betas=tuple(optim.betas),
            weight_decay=optim.weight_decay,
            lr_warmup_steps_ratio=optim.warmup_steps_ratio,
            lr_scheduler_type=optim.lr_scheduler,
            min_lr_ratio=optim.min_lr_ratio,
            total_training_steps=total_training_steps,
            grad_clip=optim.clip_grad,
        ),
        micro_batch_size_per_gpu=cfg.data.micro_batch_size_per_gpu,
        param_dtype=fsdp.dtype,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        reshard_after_forward=fsdp.reshard_after_forward,
        use_remove_padding=model.use_remove_padding,
        lora_rank=model.lora_rank,
        lora_alpha=model.lora_alpha,
        target_modules=model.target_modules_value,
        lora_adapter_path=model.lora_adapter_path,
    )


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

    def __init__(self, config: SFTConfig, runtime: SFTRuntime) -> None:
        super().__init__()
        self.config, self.runtime = config, runtime
        self.engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the model (LoRA-wrapped if configured) and its optimizer (collective with several ranks)."""
        if self.runtime.num_threads > 0:
            torch.set_num_threads(self.runtime.num_threads)
        torch.manual_seed(self.config.trainer.seed)
        if self.world_size > 1:
            self.init_distributed()
        model = self.config.model
        model_path = resolve_model_path(model.partial_pretrain)
        self.tokenizer = load_tokenizer(model.tokenizer_path or model_path)
        engine_config = build_sft_engine_config(self.config, self.runtime.total_training_steps)
        self.engine = build_fsdp_engine(model_path, engine_config, tokenizer=self.tokenizer)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's share; metrics `train/loss`, `train/grad_norm`, `train/lr`."""
        start = time.perf_counter()
        data = with_targets(data)
        counts = compute_global_counts(data.batch["loss_mask"][:, 1:])
        result = self.engine.train_batch(data, sft_loss_fn(counts.num_tokens, counts.dp_size), scale_by_rows=False)
        self.engine.lr_scheduler_step()
        metrics = {
            "train/loss": result["loss"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/num_skipped_steps": result["num_skipped_steps"],
            "timing_s/train_step_worker": time.perf_counter() - start,
        }
        return DataProto.from_dict({}, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_loss(self, data: DataProto) -> DataProto:
        """Per sample: `nll_sum` (summed NLL of its loss-masked tokens) and `num_tokens` (both (bs,) float)."""
        data = with_targets(data)
        log_probs, _ = self.engine.compute_log_prob(data)
        mask = data.batch["loss_mask"][:, 1:].to(log_probs.dtype)
        return DataProto.from_dict({"nll_sum": -(log_probs * mask).sum(-1), "num_tokens": mask.sum(-1)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """Model/optimizer shards, scheduler and RNG (and `lora_adapter/` for LoRA) into `local_path`."""
        self.engine.save_checkpoint(local_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore what `save_checkpoint` wrote (same world size)."""
        self.engine.load_checkpoint(local_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_pid_and_rss(self) -> tuple[int, int]:
        """(pid, peak resident set size in bytes) of this worker's process."""
        import resource

        return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
