"""The SFT trainer's config: one frozen dataclass per component with verl's SFT keys, and its cross-checks.

`data.*`, `model.partial_pretrain`, `model.lora_*`, `optim.*` (`warmup_steps_ratio`, `clip_grad`,
`lr_scheduler`) and `trainer.*` follow verl's `sft_trainer.yaml`. Sharding settings reuse the RL trainer's
`FSDPConfig` (`model.fsdp_config.*`), Ray settings its `RayInitConfig` (`ray_init.*`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hybridflow.trainer.config.schema import RayInitConfig
from hybridflow.trainer.config.validate import LOGGER_PACKAGES, model_context_length
from hybridflow.workers.config import FSDPConfig, check_choice, check_lora_adapter_path, check_positive


@dataclass(frozen=True, kw_only=True)
class MultiturnConfig:
    """Whole conversations instead of prompt/response pairs."""

    enable: bool = False
    """Read conversations from messages_key; loss only on assistant turns."""
    messages_key: str = "messages"
    """Column of the conversation (list of {role, content})."""
    tools_key: str = "tools"
    """Optional column of tool schemas passed to the chat template."""


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
    """Training/validation data and batch sizes."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files of training samples."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files for the validation loss; empty disables validation."""
    prompt_key: str = "prompt"
    """Single-turn: column of the prompt (str, or chat messages)."""
    response_key: str = "response"
    """Single-turn: column of the response (str)."""
    prompt_dict_keys: list[str] = field(default_factory=list)
    """Keys inside a dict-valued prompt column (e.g. [question] for prompt_key=extra_info)."""
    response_dict_keys: list[str] = field(default_factory=list)
    """Keys inside a dict-valued response column."""
    multiturn: MultiturnConfig = field(default_factory=MultiturnConfig)
    """Multi-turn conversations."""
    max_length: int = 1024
    """Most tokens per sample after the chat template."""
    truncation: str = "error"
    """Longer samples: error | left | right."""
    train_batch_size: int = 256
    """Samples per optimizer step, over all ranks."""
    micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank (gradient accumulation fills the batch)."""
    shuffle: bool = True
    """Shuffle training samples (seeded, resumable)."""
    seed: int = 1
    """Seed of the data order."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for tokenizer.apply_chat_template."""

    def __post_init__(self) -> None:
        check_positive("data.train_batch_size", self.train_batch_size)
        check_positive("data.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")
        check_choice("data.truncation", self.truncation, ("error", "left", "right"))


@dataclass(frozen=True, kw_only=True)
class SFTModelConfig:
    """The model to fine-tune."""

    partial_pretrain: str = "smollm2-135m-instruct"
    """A catalogue name, a local HF directory, or a .gguf file."""
    tokenizer_path: Optional[str] = None
    """Tokenizer location if different from partial_pretrain."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_remove_padding: bool = False
    """Pack the samples of a micro-batch without padding."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    target_modules: Any = "all-linear"
    """Modules that get LoRA adapters: all-linear, or a list of module names ([q_proj, v_proj])."""
    lora_adapter_path: Optional[str] = None
    """A peft adapter directory to continue training."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding and offload."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint directory."""

    def __post_init__(self) -> None:
        if not self.partial_pretrain:
            raise ValueError("model.partial_pretrain is empty; set a catalogue name, HF directory or .gguf file")
        if self.lora_rank < 0:
            raise ValueError(f"model.lora_rank must be >= 0 (0 trains all weights), got {self.lora_rank}")
        modules = self.target_modules
        names = isinstance(modules, (list, tuple)) and all(isinstance(name, str) for name in modules)
        if not (isinstance(modules, str) or names):
            raise ValueError(f"model.target_modules must be 'all-linear' or a list of module names, got {modules!r}")
        check_lora_adapter_path("model.lora_adapter_path", self.lora_adapter_path, self.lora_rank)

    @property
    def target_modules_value(self) -> str | tuple[str, ...]:
        """target_modules as the engine takes it."""
        return self.target_modules if isinstance(self.target_modules, str) else tuple(self.target_modules)


@dataclass(frozen=True, kw_only=True)
class SFTOptimConfig:
    """AdamW and its schedule (verl's SFT keys)."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps_ratio: float = 0.1
    """Linear warm-up as a fraction of the training steps."""
    clip_grad: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    lr_scheduler: str = "cosine"
    """cosine | linear | constant (after warm-up)."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear decay as a fraction of lr."""

    def __post_init__(self) -> None:
        check_positive("optim.lr", self.lr)
        check_choice("optim.lr_scheduler", self.lr_scheduler, ("cosine", "linear", "constant"))
        if not 0.0 <= self.warmup_steps_ratio < 1.0:
            raise ValueError(f"optim.warmup_steps_ratio must be in [0, 1), got {self.warmup_steps_ratio}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two numbers, got {self.betas}")


@dataclass(frozen=True, kw_only=True)
class SFTTrainerConfig:
    """The run: length, logging, validation, checkpoints, placement."""

    project_name: str = "hybridflow-sft"
    """Tracking project."""
    experiment_name: str = "sft"
    """Tracking run name."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Any of console, file, tensorboard, wandb, mlflow."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (None: total_epochs x steps per epoch)."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: int = -1
    """Validation loss every N steps (-1: only at the end)."""
    val_before_train: bool = True
    """Measure the validation loss before the first step."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoints (global_step_N/) and metrics of the run."""
    resume_mode: str = "auto"
    """auto (latest checkpoint if any) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """A global_step_N directory for resume_mode=resume_path."""
    max_ckpt_to_keep: Optional[int] = None
    """Older checkpoints are deleted beyond this many; None keeps all."""
    seed: int = 1
    """Seed of weight init (LoRA) and dropout."""
    nnodes: int = 1
    """Nodes used."""
    n_gpus_per_node: int = 1
    """Workers per node (accelerators per node on GPU hosts, CPU workers on CPU hosts)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    local_mode: bool = False
    """Run the one worker in the driver process without Ray (needs n_gpus_per_node=1, nnodes=1)."""
    num_threads_per_worker: int = 0
    """torch threads per worker on CPU hosts; 0 divides the cores among the workers."""

    def __post_init__(self) -> None:
        for name in self.logger:
            check_choice("trainer.logger entry", name, ("console", "file", "tensorboard", "wandb", "mlflow"))
        check_positive("trainer.total_epochs", self.total_epochs)
        check_positive("trainer.total_training_steps", self.total_training_steps, allow_none=True)
        check_positive("trainer.nnodes", self.nnodes)
        check_positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        check_choice("trainer.resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        check_choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<global_step_N dir>")
        if self.local_mode and self.world_size != 1:
            raise ValueError(
                f"trainer.local_mode=True runs one worker in the driver; set trainer.n_gpus_per_node=1 "
                f"trainer.nnodes=1 (got {self.nnodes} x {self.n_gpus_per_node})"
            )

    @property
    def world_size(self) -> int:
        """Data-parallel ranks."""
        return self.nnodes * self.n_gpus_per_node


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The whole SFT config (the root that command-line overrides address)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


def validate_sft_config(cfg: SFTConfig) -> list[tuple[str, int]]:
    """Cross-component checks (files, batch arithmetic, model, loggers); returns the batch table rows."""
    data, world = cfg.data, cfg.trainer.world_size
    if not data.train_files:
        raise ValueError("data.train_files is empty; give parquet files, e.g. data.train_files=[data/train.parquet]")
    for key, paths in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for path in paths:
            if not Path(path).is_file():
                raise ValueError(f"{key} entry {path!r} does not exist")
    if data.train_batch_size % world:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} cannot be split over {world} ranks "
            f"(trainer.nnodes x trainer.n_gpus_per_node); make it a multiple of {world}"
        )
    per_rank = data.train_batch_size // world
    if per_rank % data.micro_batch_size_per_gpu:
        raise ValueError(
            f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} does not divide the {per_rank} samples "
            f"per rank (data.train_batch_size={data.train_batch_size} / {world} ranks); use a divisor of {per_rank}"
        )
    _check_model(cfg)
    for name in cfg.trainer.logger:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(f"trainer.logger includes {name!r} but {package} is not installed; pip install {package}")
    return [
        ("ranks (nnodes x n_gpus_per_node)", world),
        ("samples per step (data.train_batch_size)", data.train_batch_size),
        ("samples per rank", per_rank),
        ("micro-batch per rank (micro_batch_size_per_gpu)", data.micro_batch_size_per_gpu),
        ("gradient accumulation steps", per_rank // data.micro_batch_size_per_gpu),
    ]


def _check_model(cfg: SFTConfig) -> None:
    from hybridflow.models import MODEL_CATALOGUE

    model = cfg.model
    path = model.partial_pretrain
    if path not in MODEL_CATALOGUE and not Path(path).exists():
        raise ValueError(f"model.partial_pretrain={path!r} is not a catalogue name, directory or .gguf file")
    if model.lora_adapter_path is not None and not (Path(model.lora_adapter_path) / "adapter_config.json").is_file():
        raise ValueError(f"model.lora_adapter_path={model.lora_adapter_path!r} holds no adapter_config.json")
    context = model_context_length(path)
    if context is not None and cfg.data.max_length > context:
        raise ValueError(
            f"data.max_length={cfg.data.max_length} exceeds the model's context of {context} tokens ({path}); lower it"
        )


def format_batch_table(rows: list[tuple[str, int]]) -> str:
    """The rows of `validate_sft_config` as aligned text."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(["[sft]"] + [f"  {label:<{width}}  {value}" for label, value in rows])
