"""Typed, frozen configuration of the training engine: optimizer/scheduler and FSDP2 settings.

Field names follow verl (`optim.lr`, `optim.lr_warmup_steps_ratio`, `micro_batch_size_per_gpu`, ...) so a
verl user finds them under `actor_rollout_ref.actor` / `critic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    lr_warmup_steps: int = -1
    """Linear warm-up steps; -1 uses `lr_warmup_steps_ratio * total_training_steps`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of `total_training_steps` (used when `lr_warmup_steps` is -1)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up: constant, linear decay to `min_lr_ratio`, or cosine decay to `min_lr_ratio`."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr` for the linear and cosine schedules."""
    total_training_steps: int = -1
    """Scheduler length in `lr_scheduler_step()` calls; the trainer fills it in. -1: unknown (constant only)."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still measured and reported)."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1], got {self.lr_warmup_steps_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.lr_scheduler_type != "constant" and self.total_training_steps <= 0:
            raise ValueError(
                f"optim.lr_scheduler_type={self.lr_scheduler_type!r} needs optim.total_training_steps > 0, "
                f"got {self.total_training_steps}; set it or use lr_scheduler_type='constant'"
            )
        if self.lr_warmup_steps < 0 and self.lr_warmup_steps_ratio > 0 and self.total_training_steps <= 0:
            raise ValueError(
                f"optim.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} needs optim.total_training_steps > 0; "
                "set total_training_steps or give lr_warmup_steps directly"
            )

    @property
    def num_warmup_steps(self) -> int:
        """Warm-up length in scheduler steps, from `lr_warmup_steps` or the ratio."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * max(self.total_training_steps, 0))


@dataclass(frozen=True, kw_only=True)
class FSDPEngineConfig:
    """FSDP2 training engine: sharding, precision, memory savers and micro-batching."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    micro_batch_size_per_gpu: int = 1
    """Sequences per forward/backward on one rank; gradients are accumulated over micro-batches."""
    param_dtype: Dtype = "auto"
    """Compute dtype of parameters in forward/backward; 'auto': bfloat16 on GPU, float32 on CPU.
    Master weights and optimizer state stay float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (saves memory, costs ~30% more compute)."""
    param_offload: bool = False
    """Keep sharded parameters and gradients on CPU (FSDP2 CPUOffloadPolicy; the optimizer step then runs on CPU)."""
    optimizer_offload: bool = False
    """Move optimizer state to CPU between updates (the worker calls `offload_to_cpu` / `load_to_device`)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2, faster)."""
    use_remove_padding: bool = False
    """Pack the non-pad tokens of a micro-batch into one row (position ids restart per sequence)."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = "sdpa"
    """Attention kernel used by the model."""
    lora_rank: int = 0
    """LoRA adapter rank (peft); 0 trains all weights. With LoRA only the adapters train and the base weights
    stay frozen (the reference policy is the same model with the adapter disabled)."""
    lora_alpha: float = 16
    """LoRA scaling numerator (update = lora_alpha / lora_rank * B @ A)."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """Modules that get adapters: 'all-linear' (every linear layer but the output head) or module names."""
    lora_adapter_path: str | None = None
    """A peft adapter directory to continue training (its adapter_config.json sets rank and alpha)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size_per_gpu < 1:
            raise ValueError(f"micro_batch_size_per_gpu must be >= 1, got {self.micro_batch_size_per_gpu}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 disables LoRA), got {self.lora_rank}")

    @property
    def use_lora(self) -> bool:
        """True when the engine trains LoRA adapters instead of all weights."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None
