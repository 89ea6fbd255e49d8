"""Config of the role workers (actor, rollout, reference, critic): one frozen dataclass per component.

The trainer's root config (`hybridflow.trainer.config.schema.PPOConfig`) nests these under verl's keys
(`actor_rollout_ref.*`, `critic.*`). They live here, with the workers, because workers are built from them
and no layer may import the trainer. Fixed choices are `str` checked in `__post_init__` (OmegaConf 2.3 rejects
`Literal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming `key` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {list(choices)}")


def check_lora_adapter_path(key: str, path: str | None, lora_rank: int) -> None:
    """Raise a ValueError naming `key` unless `path` is None or a peft adapter directory used with LoRA."""
    if path is None:
        return
    import os

    if lora_rank <= 0:
        raise ValueError(f"{key}={path!r} needs LoRA: set the matching lora_rank > 0 (the adapter's rank)")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(
            f"{key}={path!r} is not a peft adapter directory (no adapter_config.json); point it at an SFT "
            "checkpoint's lora_adapter/ folder"
        )


def check_positive(key: str, value: float | int | None, allow_none: bool = False) -> None:
    """Raise a ValueError naming `key` unless `value` > 0."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{key} must be > 0, got {value}")


# ----------------------------------------------------------------------------- models and optimizers
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which weights to load and how to wrap them."""

    path: str = "smollm2-135m-instruct"
    """A catalogue name (smollm2-135m-instruct), a local HF directory, or a .gguf file."""
    tokenizer_path: Optional[str] = None
    """Tokenizer location if different from path."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_remove_padding: bool = False
    """Pack sequences without padding in training forwards."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    target_modules: str = "all-linear"
    """Modules that get LoRA adapters: all-linear, or comma-separated module names (q_proj,v_proj)."""
    lora_adapter_path: Optional[str] = None
    """A peft adapter directory (e.g. an SFT checkpoint's lora_adapter/) to start LoRA training from."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint directory."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("actor_rollout_ref.model.path is empty; set a catalogue name, HF directory or .gguf file")
        if self.lora_rank < 0:
            raise ValueError(f"model.lora_rank must be >= 0, got {self.lora_rank}")
        check_lora_adapter_path("actor_rollout_ref.model.lora_adapter_path", self.lora_adapter_path, self.lora_rank)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warm-up steps; -1 derives them from lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the total training steps."""
    lr_scheduler_type: str = "constant"
    """constant | linear | cosine (after warm-up)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    total_training_steps: int = -1
    """Steps of the schedule; -1 takes the trainer's total."""

    def __post_init__(self) -> None:
        check_positive("optim.lr", self.lr)
        check_choice("optim.lr_scheduler_type", self.lr_scheduler_type, ("constant", "linear", "cosine"))
        if not 0.0 <= self.lr_warmup_steps_ratio < 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1), got {self.lr_warmup_steps_ratio}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas needs two numbers, got {self.betas}")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """How a model is sharded (FSDP2) and what is offloaded."""

    param_offload: bool = False
    """Keep parameters on the CPU between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU between updates."""
    dtype: str = "auto"
    """Parameter dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2)."""

    def __post_init__(self) -> None:
        check_choice("fsdp_config.dtype", self.dtype, ("auto", "float32", "bfloat16"))


@dataclass(frozen=True, kw_only=True)
class PolicyLossSelection:
    """Which registered policy loss the actor optimizes."""

    loss_mode: str = "vanilla"
    """A registered policy loss: vanilla | gspo | gpg | clip_cov | kl_cov | sapo | cispo | geo_mean | ..."""


@dataclass(frozen=True, kw_only=True)
class CheckpointContents:
    """What a checkpoint holds."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Parts to save: model, optimizer, extra (scheduler, RNG), hf_model (a plain HF directory)."""


# ----------------------------------------------------------------------------- actor, rollout, ref
@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """PPO update of the policy."""

    strategy: str = "fsdp2"
    """Training engine: fsdp2."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times rollout.n samples), before splitting over ranks."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank (gradient accumulation fills the mini-batch)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    shuffle: bool = False
    """Shuffle samples between PPO epochs."""
    clip_ratio: float = 0.2
    """PPO clip epsilon."""
    clip_ratio_low: Optional[float] = None
    """Lower clip epsilon (DAPO clip-higher); None uses clip_ratio."""
    clip_ratio_high: Optional[float] = None
    """Upper clip epsilon; None uses clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl | abs | mse | low_var_kl | k1 | k2 | k3, and '+' variants."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    policy_loss: PolicyLossSelection = field(default_factory=PolicyLossSelection)
    """Which policy loss to use."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the actor."""
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)
    """What actor checkpoints hold."""

    def __post_init__(self) -> None:
        check_choice("actor_rollout_ref.actor.strategy", self.strategy, ("fsdp2",))
        check_positive("actor_rollout_ref.actor.ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        check_positive("actor_rollout_ref.actor.ppo_epochs", self.ppo_epochs)
        check_positive("actor_rollout_ref.actor.clip_ratio", self.clip_ratio)
        check_positive("actor_rollout_ref.actor.grad_clip", self.grad_clip)


@dataclass(frozen=True, kw_only=True)
class ValSamplingConfig:
    """Sampling used for validation."""

    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    n: int = 1
    """Samples per validation prompt (mean@n, best@n, maj@n)."""
    do_sample: bool = False
    """False is greedy decoding."""


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """Multi-turn generation with tools and interactions (`rollout.mode=async`, agent `tool_agent`)."""

    enable: bool = False
    """Use the tool agent loop for rows without an `agent_name`."""
    max_assistant_turns: int = 5
    """Model turns per trajectory."""
    max_user_turns: int = 3
    """Interaction (simulated user) turns per trajectory."""
    max_tokens_per_turn: Optional[int] = None
    """New tokens per model turn (None: whatever is left of data.max_response_length)."""
    max_parallel_calls: int = 4
    """Tool calls executed from one model turn; extra calls get an error message."""
    max_tool_response_length: int = 256
    """Characters of a tool's output kept in the conversation."""
    tool_response_truncate_side: str = "middle"
    """left | middle | right: which part of a long tool output is cut."""
    tool_config_path: Optional[str] = None
    """YAML file listing the tools (verl's format: `tools: [{class_name|name, config, tool_schema}]`)."""
    interaction_config_path: Optional[str] = None
    """YAML file listing interactions (`interaction: [{name, class_name, config}]`)."""
    format: str = "hermes"
    """Tool-call format parsed from model text."""

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.multi_turn"
        check_positive(f"{prefix}.max_assistant_turns", self.max_assistant_turns)
        check_positive(f"{prefix}.max_parallel_calls", self.max_parallel_calls)
        check_positive(f"{prefix}.max_tokens_per_turn", self.max_tokens_per_turn, allow_none=True)
        check_positive(f"{prefix}.max_tool_response_length", self.max_tool_response_length)
        if self.max_user_turns < 0:
            raise ValueError(f"{prefix}.max_user_turns must be >= 0, got {self.max_user_turns}")
        check_choice(f"{prefix}.tool_response_truncate_side", self.tool_response_truncate_side, ("left", "middle", "right"))


@dataclass(frozen=True, kw_only=True)
class AgentLoopConfig:
    """How the driver runs agent loops against the rollout replicas' generation servers."""

    default_agent_loop: str = "single_turn_agent"
    """Loop for rows without an `agent_name` field (tool_agent when multi_turn.enable)."""
    max_concurrent_loops: int = 64
    """Agent loops in flight at once; their requests are batched by each replica's server."""
    max_concurrent_requests_per_replica: int = 64
    """Worker threads serving requests per rollout replica (the Ray actor's max_concurrency)."""
    server_batch_wait_s: float = 0.2
    """A replica's server starts a batch once no request has come for this long (at most 10x it after the
    first): concurrent loops' requests arrive spread out by the driver's tokenization and Ray, and a batch
    that starts too early leaves them for the next one. Small against a batch's generation time."""

    def __post_init__(self) -> None:
        check_positive("actor_rollout_ref.rollout.agent.max_concurrent_loops", self.max_concurrent_loops)
        if self.server_batch_wait_s < 0:
            raise ValueError(f"actor_rollout_ref.rollout.agent.server_batch_wait_s must be >= 0, got {self.server_batch_wait_s}")
        check_positive(
            "actor_rollout_ref.rollout.agent.max_concurrent_requests_per_replica", self.max_concurrent_requests_per_replica
        )


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation of responses."""

    name: str = "hf"
    """Rollout engine: hf | native | vllm."""
    mode: str = "sync"
    """sync (batch generate) | async (generation server for agent loops)."""
    n: int = 1
    """Responses sampled per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    do_sample: bool = True
    """False is greedy decoding."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward when recomputing log-probs."""
    tensor_model_parallel_size: int = 1
    """Tensor parallel size of the rollout engine."""
    gpu_memory_utilization: float = 0.5
    """Fraction of accelerator memory the rollout engine may take (vllm)."""
    free_cache_engine: bool = True
    """Free the rollout engine's KV cache after generation (hybrid engine)."""
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampling for validation."""
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """Agent loops (mode=async)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tools, interactions and turn limits of the tool agent loop."""

    def __post_init__(self) -> None:
        check_choice("actor_rollout_ref.rollout.mode", self.mode, ("sync", "async"))
        check_positive("actor_rollout_ref.rollout.n", self.n)
        if self.temperature < 0:
            raise ValueError(f"actor_rollout_ref.rollout.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {self.top_p}")
        check_positive("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """The frozen reference policy (for KL)."""

    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward when computing reference log-probs."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reference model."""


@dataclass(frozen=True, kw_only=True)
class ActorRolloutRefConfig:
    """The hybrid-engine worker: actor training, rollout and reference in one process per rank."""

    hybrid_engine: bool = True
    """Colocate actor, rollout and reference (the only mode of this trainer)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy weights."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """PPO update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy."""


# ----------------------------------------------------------------------------- critic and rewards
@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The value model used by GAE."""

    enable: Optional[bool] = None
    """None: on exactly when algorithm.adv_estimator needs values (gae)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Critic backbone weights (a value head is added)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = 256
    """Prompts per critic optimizer step (times rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank."""
    forward_micro_batch_size_per_gpu: int = 8
    """Samples per forward when computing values."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the critic."""

    def __post_init__(self) -> None:
        check_positive("critic.ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("critic.ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        check_positive("critic.ppo_epochs", self.ppo_epochs)


@dataclass(frozen=True, kw_only=True)
class WorkerRuntimeConfig:
    """What the trainer derives for its workers from the data and trainer config."""

    prompt_length: int
    """Prompt tokens (data.max_prompt_length)."""
    response_length: int
    """Most generated tokens (data.max_response_length)."""
    total_training_steps: int = -1
    """Length of the learning-rate schedule in steps."""
    seed: int = 1
    """Seed of weights init and sampling (trainer.seed)."""
    num_threads: int = 0
    """torch intra-op threads of this worker; 0 leaves torch's default."""


def build_engine_config(
    optim: OptimConfig,
    fsdp: FSDPConfig,
    model: ModelConfig,
    micro_batch_size_per_gpu: int,
    grad_clip: float,
    total_training_steps: int,
):
    """The training engine's config for one model (actor, ref or critic)."""
    from hybridflow.engines.training.config import FSDPEngineConfig
    from hybridflow.engines.training.config import OptimConfig as EngineOptimConfig

    steps = optim.total_training_steps if optim.total_training_steps > 0 else total_training_steps
    return FSDPEngineConfig(
        optim=EngineOptimConfig(
            lr=optim.lr,
            betas=tuple(optim.betas),
            weight_decay=optim.weight_decay,
            lr_warmup_steps=optim.lr_warmup_steps,
            lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
            lr_scheduler_type=optim.lr_scheduler_type,
            min_lr_ratio=optim.min_lr_ratio,
            total_training_steps=steps,
            grad_clip=grad_clip,
        ),
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
        param_dtype=fsdp.dtype,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        reshard_after_forward=fsdp.reshard_after_forward,
        use_remove_padding=model.use_remove_padding,
        lora_rank=model.lora_rank,
        lora_alpha=model.lora_alpha,
        target_modules=lora_target_modules(model.target_modules),
        lora_adapter_path=model.lora_adapter_path,
    )


def lora_target_modules(value: str) -> str | tuple[str, ...]:
    """'all-linear' stays as is; 'q_proj,v_proj' becomes ('q_proj', 'v_proj')."""
    if value == "all-linear":
        return value
    return tuple(name.strip() for name in value.split(",") if name.strip())


def prepare_worker_process(worker, runtime: WorkerRuntimeConfig, model: ModelConfig):
    """Threads, seed and process group of a role worker's process; returns (resolved model path, tokenizer).

    Threads: Ray gives 1-CPU actors OMP_NUM_THREADS=1, so torch's count is set deliberately.
    """
    import torch

    from hybridflow.models import load_tokenizer, resolve_model_path

    if runtime.num_threads > 0:
        torch.set_num_threads(runtime.num_threads)
    torch.manual_seed(runtime.seed)
    if worker.world_size > 1:
        worker.init_distributed()
    model_path = resolve_model_path(model.path)
    return model_path, load_tokenizer(model.tokenizer_path or model_path)
