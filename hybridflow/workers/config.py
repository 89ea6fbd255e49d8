"""Config of the role workers (actor, rollout, reference, critic): one frozen dataclass per component.

The trainer's root nests these under verl's keys (`actor_rollout_ref.*`, `critic.*`). Loss hyper-parameters
come from `algorithms` (`PPOLossConfig`, which `ActorConfig` extends), the model, optimizer and sharding
sections from `models` and `engines`; this module adds batch sizes, epochs and checkpoint contents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from hybridflow.algorithms.config import LossAggMode, PPOLossConfig
from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.engines.training.config import (
    FSDPConfig,
    FSDPEngineConfig,
    FSDPModelConfig,
    OptimConfig,
    RouterReplayConfig,
)
from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, unsupported
from hybridflow.utils.profiler_config import RoleProfilerConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "CheckpointConfig",
    "CriticConfig",
    "RefConfig",
    "RefModelConfig",
    "RewardModelModelConfig",
    "RewardModelWorkerConfig",
    "RewardServingConfig",
    "WorkerRuntimeConfig",
]

Strategy = Literal["fsdp", "fsdp2"]
"""Both names run FSDP2 (`fully_shard`); verl's FSDP1 path does not exist here."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What a checkpoint holds."""

    save_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] = field(
        default_factory=lambda: ["model", "optimizer", "extra"]
    )
    """Parts to save: model, optimizer, extra (scheduler, RNG), hf_model (also a plain HF directory)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        missing = [part for part in ("model", "optimizer", "extra") if part not in self.save_contents]
        if missing:
            raise ConfigFieldError(
                "save_contents",
                f"save_contents={self.save_contents} leaves out {missing}; a checkpoint without them cannot resume "
                "(keep model, optimizer, extra; add hf_model for a plain HF copy)",
            )


def _check_clip(grad_clip: float, optim: OptimConfig) -> None:
    """`grad_clip` (verl's actor/critic key) and `optim.clip_grad` (verl's optimizer key) are one setting: the
    trainer's tree makes the latter default to the former, so they differ only when both are set."""
    check_at_least("grad_clip", grad_clip, 0.0, "0 disables clipping")
    if grad_clip != optim.clip_grad:
        raise ConfigFieldError(
            "grad_clip",
            f"grad_clip={grad_clip} and optim.clip_grad={optim.clip_grad} are the same setting; set one of them",
        )


# ----------------------------------------------------------------------------- actor, rollout, ref
@dataclass(frozen=True, kw_only=True)
class ActorConfig(PPOLossConfig):
    """PPO update of the policy: the loss (`PPOLossConfig`), batch sizes, optimizer and sharding."""

    strategy: Strategy = "fsdp2"
    """Training engine: fsdp2 (fsdp is accepted as a synonym; both shard with FSDP2)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times rollout.n samples), before splitting over ranks."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank (gradient accumulation fills the mini-batch)."""
    ppo_micro_batch_size: Optional[int] = None
    """verl's old global form of ppo_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by token count (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size_per_gpu rows."""
    ppo_max_token_len_per_gpu: int = 16384
    """Tokens (prompt + response) per micro-batch on one rank with use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    shuffle: bool = False
    """Shuffle samples between PPO epochs."""
    grad_clip: float = 1.0
    """Max global grad norm (the same setting as optim.clip_grad)."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that split one packed sequence (Ulysses all-to-all around attention); needs
    model.use_remove_padding=True. Sequence-parallel peers take the same data."""
    use_torch_compile: bool = unsupported(False, "the training engine runs eagerly")
    """Compile the model's forward."""
    entropy_checkpointing: bool = False
    """verl: recompute the entropy's logits in the backward instead of keeping them. True needs
    model.use_fused_kernels (the default), whose head already recomputes each chunk's logits in the backward."""
    entropy_from_logits_with_chunking: bool = False
    """verl: compute the entropy a chunk of positions at a time. True needs model.use_fused_kernels (the default),
    whose head computes log-probs and entropy chunk by chunk (fused_kernel_options.chunk_size positions)."""
    calculate_sum_pi_squared: bool = unsupported(
        False, "the optimal-token-baseline estimator that reads sum(pi^2) is not implemented"
    )
    """verl: compute each position's sum of squared probabilities (for its optimal_token_baseline estimator)."""
    sum_pi_squared_checkpointing: bool = unsupported(
        False, "the optimal-token-baseline estimator that reads sum(pi^2) is not implemented"
    )
    """verl: recompute sum(pi^2) in the backward."""
    use_prefix_grouper: bool = False
    """Forward the samples of one prompt with a single copy of the prompt (update, old and reference log-probs):
    the same results, with each prompt computed once per group in a micro-batch."""
    freeze_vision_tower: bool = False
    """A vision-language policy: train the language model only, the vision tower's weights stay as loaded (verl's
    key); refused for a text model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the actor."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What actor checkpoints hold."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (R3: train with the rollout's experts)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the actor (see global_profiler)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        check_positive("ppo_max_token_len_per_gpu", self.ppo_max_token_len_per_gpu)
        check_positive("ppo_epochs", self.ppo_epochs)
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        _check_clip(self.grad_clip, self.optim)

    @property
    def update_token_budget(self) -> int | None:
        """Tokens per update micro-batch, or None to cut by rows."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    def engine_config(self, model: ModelConfig, total_training_steps: int = -1) -> FSDPEngineConfig:
        """The actor's training engine, built from this section and the policy's `model` (the engine's own
        rules, e.g. sequence parallelism needs packed rows, raise here; validation calls it before Ray)."""
        return FSDPEngineConfig(
            model=model,
            fsdp=self.fsdp_config,
            optim=self.optim,
            micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu,
            total_training_steps=total_training_steps,
            share_prompts=self.use_prefix_grouper,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
            freeze_vision_tower=self.freeze_vision_tower,
        )


@dataclass(frozen=True, kw_only=True)
class RefModelConfig(ModelConfig):
    """The reference's weights (`actor_rollout_ref.ref.model.*`); `path=None` means the actor's model as it is."""

    path: Optional[str] = None
    """Reference (teacher) checkpoint: None, or the actor's path, is the actor's initial model."""

    def __post_init__(self) -> None:
        if self.path is not None:
            super().__post_init__()
        for name in ("lora_rank", "lora_adapter_path", "enable_gradient_checkpointing"):
            if getattr(self, name):
                raise ConfigFieldError(
                    name, f"{name}={getattr(self, name)!r}: the reference is frozen, leave it unset (a LoRA actor's "
                    "reference is its base model already)"
                )


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """The frozen reference policy (for KL)."""

    strategy: Strategy = "fsdp2"
    """Engine: fsdp2 (fsdp is accepted as a synonym)."""
    use_torch_compile: bool = unsupported(False, "the training engine runs eagerly")
    """Compile the model's forward."""
    entropy_checkpointing: bool = False
    """verl: as the actor's (True needs model.use_fused_kernels, whose head works chunk by chunk)."""
    entropy_from_logits_with_chunking: bool = False
    """verl: as the actor's (True needs model.use_fused_kernels, whose head works chunk by chunk)."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward when computing reference log-probs (the PPO trainer sets it from
    rollout.log_prob_micro_batch_size_per_gpu unless given; 8 applies to a reference built on its own)."""
    log_prob_micro_batch_size: Optional[int] = None
    """verl's old global form of log_prob_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    log_prob_use_dynamic_bsz: bool = False
    """Cut log-prob micro-batches by token count (log_prob_max_token_len_per_gpu) instead of rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Tokens per log-prob micro-batch on one rank with log_prob_use_dynamic_bsz."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that split one packed sequence (Ulysses all-to-all around attention); needs
    model.use_remove_padding=True. Sequence-parallel peers take the same data."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the reference model."""
    model: RefModelConfig = field(default_factory=lambda: RefModelConfig())
    """Reference weights: the actor's model unless set. Another checkpoint with the policy's tokenizer is a
    teacher: actor.use_kl_loss / algorithm.use_kl_in_reward then give on-policy distillation (the per-token
    reverse KL of the policy's own samples to the teacher)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the reference (see global_profiler)."""

    def __post_init__(self) -> None:
        check_positive("log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)
        check_positive("log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu)
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)

    @property
    def log_prob_token_budget(self) -> int | None:
        """Tokens per log-prob micro-batch, or None to cut by rows."""
        return self.log_prob_max_token_len_per_gpu if self.log_prob_use_dynamic_bsz else None

    def engine_config(self, actor_model: ModelConfig, share_prompts: bool) -> FSDPEngineConfig:
        """A separate reference engine: `model` (the actor's `actor_model` unless its path is set), never with LoRA
        adapters; `share_prompts` follows the actor's use_prefix_grouper (they take the same batches)."""
        model = self.model if self.model.path is not None else actor_model
        return FSDPEngineConfig(
            model=dataclasses.replace(model, lora_rank=0, lora_adapter_path=None),
            fsdp=self.fsdp_config,
            micro_batch_size_per_gpu=self.log_prob_micro_batch_size_per_gpu,
            share_prompts=share_prompts,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )


@dataclass(frozen=True, kw_only=True)
class ActorRolloutRefConfig:
    """The hybrid-engine worker: actor training, rollout and reference (in one process per rank, or split)."""

    hybrid_engine: bool = True
    """True: actor, rollout and reference share one process per rank (colocated). False: split placement, the
    rollout runs on its own pool (rollout.nnodes x rollout.n_gpus_per_node processes) and receives the actor's
    weights after each update."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy weights."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """PPO update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy."""
    nccl_timeout: Optional[int] = None
    """Seconds a collective of the workers' process groups (nccl on GPUs, gloo on CPUs) may wait before it fails
    with an error instead of hanging (verl's key, whose default is 600); None: torch's default (10 min for nccl,
    30 min for gloo). Every pool's process group takes it."""

    def __post_init__(self) -> None:
        self._check_router_replay()
        check_positive("nccl_timeout", self.nccl_timeout, allow_none=True)
        for section, name in (("actor", "entropy_checkpointing"), ("actor", "entropy_from_logits_with_chunking"),
                              ("ref", "entropy_checkpointing"), ("ref", "entropy_from_logits_with_chunking")):
            if getattr(getattr(self, section), name) and not self.model.use_fused_kernels:
                raise ConfigFieldError(
                    f"{section}.{name}",
                    f"actor_rollout_ref.{section}.{name}=True with actor_rollout_ref.model.use_fused_kernels=False: "
                    "the fused head is what computes the logits chunk by chunk (and again in the backward); set "
                    "use_fused_kernels=True",
                )

    def _check_router_replay(self) -> None:
        """R3 replays what the rollout records: both keys on, or both off (a recording nobody replays is refused)."""
        replay, record = self.actor.router_replay.mode == "R3", self.rollout.enable_rollout_routing_replay
        if replay != record:
            raise ConfigFieldError(
                "actor.router_replay.mode",
                f"actor_rollout_ref.actor.router_replay.mode={self.actor.router_replay.mode!r} with "
                f"actor_rollout_ref.rollout.enable_rollout_routing_replay={record}: R3 replays the rollout's recorded "
                "experts; set "
                "both (mode=R3 and enable_rollout_routing_replay=True) or neither",
            )
        if replay and (self.actor.use_prefix_grouper or self.actor.ulysses_sequence_parallel_size > 1):
            raise ConfigFieldError(
                "actor.router_replay.mode",
                "actor_rollout_ref.actor.router_replay.mode='R3' replays in the padded and packed forwards only; set "
                "actor_rollout_ref.actor.use_prefix_grouper=False and "
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
            )


# ----------------------------------------------------------------------------- critic
@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The value model used by GAE."""

    enable: Optional[bool] = None
    """None: on exactly when algorithm.adv_estimator needs values (gae)."""
    strategy: Strategy = "fsdp2"
    """Training engine: fsdp2 (fsdp is accepted as a synonym)."""
    model: FSDPModelConfig = field(default_factory=FSDPModelConfig)
    """Critic backbone weights (a value head is added) and their sharding (verl keeps it under critic.model)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = 256
    """Prompts per critic optimizer step (times rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank."""
    ppo_micro_batch_size: Optional[int] = None
    """verl's old global form of ppo_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    forward_micro_batch_size_per_gpu: int = 8
    """Samples per forward when computing values."""
    forward_micro_batch_size: Optional[int] = None
    """verl's old global form of forward_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by token count instead of rows (ppo_/forward_max_token_len_per_gpu)."""
    ppo_max_token_len_per_gpu: int = 32768
    """Tokens per update micro-batch on one rank with use_dynamic_bsz."""
    forward_max_token_len_per_gpu: int = 32768
    """Tokens per value-forward micro-batch on one rank with use_dynamic_bsz."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    shuffle: bool = False
    """Shuffle samples between epochs."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Aggregation of the value loss."""
    grad_clip: float = 1.0
    """Max global grad norm (the same setting as optim.clip_grad)."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that split one packed sequence (Ulysses all-to-all around attention); needs
    model.use_remove_padding=True. Sequence-parallel peers take the same data."""
    use_prefix_grouper: bool = False
    """Forward the samples of one prompt with a single copy of the prompt (values and update)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What critic checkpoints hold."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the critic (see global_profiler)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        check_positive("forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu)
        check_positive("ppo_epochs", self.ppo_epochs)
        check_positive("cliprange_value", self.cliprange_value)
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        _check_clip(self.grad_clip, self.optim)

    @property
    def update_token_budget(self) -> int | None:
        """Tokens per update micro-batch, or None to cut by rows."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    @property
    def forward_token_budget(self) -> int | None:
        """Tokens per value-forward micro-batch, or None to cut by rows."""
        return self.forward_max_token_len_per_gpu if self.use_dynamic_bsz else None

    def engine_config(self, total_training_steps: int = -1) -> FSDPEngineConfig:
        """The critic's training engine, built from this section (validation calls it before Ray)."""
        return FSDPEngineConfig(
            model=self.model,
            fsdp=self.model.fsdp_config,
            optim=self.optim,
            micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu,
            total_training_steps=total_training_steps,
            share_prompts=self.use_prefix_grouper,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )


# ----------------------------------------------------------------------------- reward model
@dataclass(frozen=True, kw_only=True)
class RewardModelModelConfig(FSDPModelConfig):
    """The reward model's weights (`reward_model.model.*`): a sequence- or token-classification checkpoint."""

    input_tokenizer: Optional[str] = None
    """The policy's tokenizer (defaults to actor_rollout_ref.model.path). When the reward model's tokenizer or chat
    template differ from it, each response is decoded and the conversation re-templated for the reward model;
    None feeds the policy's token ids as they are (same tokenizer and template)."""
    ref_path: Optional[str] = None
    """PRIME: the implicit PRM's frozen reference (a causal LM); None: its own initial weights (model.path)."""
    update: Literal["none", "before", "after"] = "none"
    """PRIME: train the implicit PRM on each batch's outcomes before scoring it, after (scores from the weights
    before the step), or never."""
    beta_train: float = 0.05
    """PRIME: beta of the implicit reward beta * (log pi_prm - log pi_ref)."""
    loss_type: Literal["ce"] = "ce"
    """PRIME: the implicit PRM's loss: cross-entropy of sigmoid(beta * sum q) against the outcome."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, clip_grad=10.0))
    """PRIME: the implicit PRM's optimizer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("beta_train", self.beta_train)


REWARD_SERVING_ENGINES = ("hf",)
"""Engines that serve a reward model in verl's reward loop here: transformers' forward of the checkpoint."""

_VLLM_SERVER = "a setting of verl's vLLM/SGLang reward server; hybridflow's reward forward has no such server"


@dataclass(frozen=True, kw_only=True)
class RewardServingConfig:
    """How verl's reward loop serves a discriminative reward model (`reward_model.rollout.*`, read with
    reward_model.use_reward_loop=True and enable=True): replicas of `tensor_model_parallel_size` ranks over the
    reward model's ranks (the actor's pool, or its own with enable_resource_pool), each scoring its share of the
    batch. verl runs a vLLM/SGLang server there; hybridflow runs transformers' forward of the checkpoint on its
    training engine (FSDP2 over the data-parallel ranks, DTensor tensor parallelism inside a replica), with the
    same inputs: each response decoded, the conversation re-templated in the reward model's chat template, the
    score read at its last token."""

    name: Optional[str] = None
    """Serving engine: hf (None is hf). vllm and sglang servers are not built for reward models; they are refused."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of the reward forward (the weights are loaded in float32 and cast per layer)."""
    gpu_memory_utilization: float = 0.5
    """Share of each rank's device (a GPU, or on CPU the host RAM over the node's ranks) the reward model's weight
    shard may take: loading fails naming this key when it does not fit. vLLM also sizes its KV cache from it; a
    scoring forward keeps none."""
    tensor_model_parallel_size: int = 2
    """Ranks per reward-model replica, which split its heads, MLP and vocabulary (DTensor tensor parallelism);
    the replicas take different rows. Must divide the reward model's ranks and heads (verl's default: 2)."""
    expert_parallel_size: int = 1
    """Mixture-of-experts reward models: ranks that split the routed experts (see fsdp_config.expert_parallel_size)."""
    max_num_batched_tokens: int = 8192
    """Tokens per reward forward on one rank: rows are grouped into micro-batches of about this many tokens; a
    conversation longer than that is scored whole in a micro-batch of its own (vLLM prefills it in chunks)."""
    max_model_len: Optional[int] = None
    """Most tokens of a re-templated conversation; None: prompt_length + response_length. Longer ones lose their
    start (the score is read at the end); vLLM would refuse them."""
    prompt_length: int = 2048
    """With response_length, the default of max_model_len."""
    response_length: int = 2048
    """With prompt_length, the default of max_model_len."""
    free_cache_engine: bool = True
    """Move the reward model's weights to the host between scorings (on an accelerator; the host is its home on CPU)."""
    data_parallel_size: int = unsupported(1, "replicas are the reward model's ranks over tensor_model_parallel_size")
    """verl: data-parallel ranks inside one vLLM server."""
    enforce_eager: bool = unsupported(True, "the reward forward runs eager; no CUDA graph is captured for it")
    """verl: run vLLM eager (no CUDA graphs)."""
    cudagraph_capture_sizes: Optional[list[int]] = unsupported(None, _VLLM_SERVER)
    """verl: vLLM's CUDA-graph batch sizes."""
    max_num_seqs: int = unsupported(1024, f"{_VLLM_SERVER}; micro-batches are cut by max_num_batched_tokens")
    """verl: vLLM's most concurrent sequences."""
    load_format: str = unsupported("auto", "the reward model's weights are read from reward_model.model.path")
    """verl: how vLLM reads the weights (dummy: random)."""
    engine_kwargs: dict = unsupported({}, _VLLM_SERVER)
    """verl: extra vLLM/SGLang engine arguments."""
    limit_images: Optional[int] = unsupported(None, "vision-language reward models are not supported")
    """verl: images per prompt."""
    enable_chunked_prefill: bool = unsupported(True, f"{_VLLM_SERVER}; each conversation is scored whole")
    """verl: vLLM's chunked prefill."""
    enable_prefix_caching: bool = unsupported(True, _VLLM_SERVER)
    """verl: vLLM's prefix cache."""
    disable_log_stats: bool = unsupported(True, _VLLM_SERVER)
    """verl: vLLM's statistics logging."""
    skip_tokenizer_init: bool = unsupported(False, "the reward model re-templates text with its own tokenizer")
    """verl: start the server without a tokenizer (verl asserts False for reward models)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.name is not None and self.name not in REWARD_SERVING_ENGINES:
            raise ConfigFieldError(
                "name",
                f"name={self.name!r}: hybridflow serves a discriminative reward model with transformers' forward on "
                "its own engine (FSDP2, tensor parallelism), not a vLLM/SGLang server; set reward_model.rollout.name=hf",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigFieldError(
                "gpu_memory_utilization", f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        for key in ("tensor_model_parallel_size", "expert_parallel_size", "max_num_batched_tokens", "prompt_length",
                    "response_length"):
            check_positive(key, getattr(self, key))
        check_at_least("max_model_len", self.max_model_len if self.max_model_len is not None else 2, 2)

    @property
    def max_input_tokens(self) -> int:
        """Most tokens of one scored conversation."""
        return self.max_model_len or self.prompt_length + self.response_length


@dataclass(frozen=True, kw_only=True)
class RewardModelWorkerConfig:
    """A learned reward model that scores each response (`reward_model.*`): the worker's part of the section."""

    enable: bool = False
    """Score responses with the reward model (its score replaces, or with rule_reward_coef joins, rule rewards)."""
    use_reward_loop: bool = False
    """verl's reward loop. Rule rewards are scored the same either way (in the driver's scorer pool, whose size
    reward_model.num_workers sets, as verl's reward-loop workers). With a reward model (enable=True), True serves it
    as `rollout` says: replicas of rollout.tensor_model_parallel_size ranks, every conversation re-templated for
    the reward model, micro-batches of rollout.max_num_batched_tokens; False scores it with the legacy worker's
    settings (model.fsdp_config, micro_batch_size_per_gpu, max_length, use_dynamic_bsz)."""
    rollout: RewardServingConfig = field(default_factory=RewardServingConfig)
    """How the reward loop serves the reward model (read with use_reward_loop=True and enable=True)."""
    strategy: Strategy = "fsdp2"
    """Engine: fsdp2 (fsdp is accepted as a synonym)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """Reward-model weights, tokenizer and sharding."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the reward model (see global_profiler)."""
    micro_batch_size_per_gpu: Optional[int] = None
    """Sequences per reward-model forward on one rank; None: the rank's whole share at once. Under the reward loop,
    micro-batches are cut by rollout.max_num_batched_tokens, at least one per this many rows."""
    micro_batch_size: Optional[int] = None
    """verl's old global form of micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    max_length: Optional[int] = None
    """Most tokens of a re-templated conversation (the start is cut, the response end kept); None: no limit."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by token count (forward_max_token_len_per_gpu) instead of rows."""
    forward_max_token_len_per_gpu: int = 32768
    """Tokens per micro-batch on one rank with use_dynamic_bsz."""
    enable_resource_pool: bool = False
    """Place the reward model on its own resource pool (reward_pool: nnodes x n_gpus_per_node processes) instead of
    the actor's processes: its weights and forwards then never share a device with the actor's."""
    n_gpus_per_node: int = 0
    """Processes (GPUs, or CPU workers on CPU nodes) per node of the reward model's own pool."""
    nnodes: int = 0
    """Nodes of the reward model's own pool."""
    ulysses_sequence_parallel_size: int = unsupported(1, "sequence parallelism is not implemented yet")
    """Ranks that split one sequence (Ulysses)."""
    prime_granularity: Literal["token", "whole"] = "token"
    """PRIME: implicit rewards on every response token, or their sum on the last one."""
    prime_norm: Literal["batch_norm", "none"] = "batch_norm"
    """PRIME: divide the implicit rewards by the batch's largest |return| (batch_norm) or leave them."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, allow_none=True)
        check_at_least("max_length", self.max_length if self.max_length is not None else 2, 2)
        check_positive("forward_max_token_len_per_gpu", self.forward_max_token_len_per_gpu)
        self._check_resource_pool()
        self._check_reward_loop()

    def _check_reward_loop(self) -> None:
        """`rollout` is read only when the reward loop serves a reward model, and then the legacy worker's layout
        and micro-batch keys are not: a value set for the side that does not run is refused."""
        if not self.serves_in_reward_loop:
            if self.rollout != RewardServingConfig():
                raise ConfigFieldError(
                    "rollout",
                    "reward_model.rollout.* serves the reward model in verl's reward loop, which runs with "
                    f"reward_model.enable=True and use_reward_loop=True (got enable={self.enable}, use_reward_loop="
                    f"{self.use_reward_loop}); set both, or drop the reward_model.rollout keys",
                )
            return
        legacy = FSDPConfig()
        for key, value, default, loop_key in (
            ("max_length", self.max_length, None, "rollout.max_model_len"),
            ("reward_model.model.fsdp_config.tensor_parallel_size", self.model.fsdp_config.tensor_parallel_size,
             legacy.tensor_parallel_size, "rollout.tensor_model_parallel_size"),
            ("reward_model.model.fsdp_config.expert_parallel_size", self.model.fsdp_config.expert_parallel_size,
             legacy.expert_parallel_size, "rollout.expert_parallel_size"),
            ("reward_model.model.fsdp_config.dtype", self.model.fsdp_config.dtype, legacy.dtype, "rollout.dtype"),
        ):
            if value != default:
                raise ConfigFieldError(
                    key.rpartition(".")[2],
                    f"{key}={value!r} sets the legacy reward-model worker, but use_reward_loop=True serves the reward "
                    f"model as reward_model.rollout says; set reward_model.{loop_key} instead, or use_reward_loop=False",
                )

    @property
    def serves_in_reward_loop(self) -> bool:
        """Whether the reward model is served as verl's reward loop serves it (`rollout`)."""
        return self.enable and self.use_reward_loop

    @property
    def serving_fsdp(self) -> FSDPConfig:
        """The reward model's sharding and compute dtype: model.fsdp_config, with the reward loop's layout and dtype
        when it serves the model."""
        if not self.serves_in_reward_loop:
            return self.model.fsdp_config
        return dataclasses.replace(
            self.model.fsdp_config, tensor_parallel_size=self.rollout.tensor_model_parallel_size,
            expert_parallel_size=self.rollout.expert_parallel_size, dtype=self.rollout.dtype,
        )

    @property
    def layout_keys(self) -> tuple[str, str]:
        """The keys that set the reward model's tensor- and expert-parallel sizes (named in layout errors)."""
        if self.serves_in_reward_loop:
            return "reward_model.rollout.tensor_model_parallel_size", "reward_model.rollout.expert_parallel_size"
        section = "reward_model.model.fsdp_config"
        return f"{section}.tensor_parallel_size", f"{section}.expert_parallel_size"

    def _check_resource_pool(self) -> None:
        """The own pool's size is given exactly when the pool is asked for, for an enabled reward model."""
        sizes = f"reward_model.nnodes={self.nnodes} reward_model.n_gpus_per_node={self.n_gpus_per_node}"
        if not self.enable_resource_pool:
            if self.nnodes or self.n_gpus_per_node:
                raise ConfigFieldError(
                    "enable_resource_pool",
                    f"{sizes} size the reward model's own pool, but enable_resource_pool=False places it with the "
                    "actor; set reward_model.enable_resource_pool=True or drop the sizes",
                )
            return
        if not self.enable:
            raise ConfigFieldError(
                "enable_resource_pool",
                "enable_resource_pool=True places a reward model that is not enabled; set reward_model.enable=True",
            )
        if self.nnodes <= 0 or self.n_gpus_per_node <= 0:
            raise ConfigFieldError(
                "enable_resource_pool",
                f"enable_resource_pool=True needs the pool's size: got {sizes}; set both > 0 (e.g. "
                "reward_model.nnodes=1 reward_model.n_gpus_per_node=1)",
            )

    @property
    def forward_token_budget(self) -> int | None:
        """Tokens per forward micro-batch, or None to cut by rows."""
        if self.serves_in_reward_loop:
            return self.rollout.max_num_batched_tokens
        return self.forward_max_token_len_per_gpu if self.use_dynamic_bsz else None

    @property
    def max_input_tokens(self) -> int | None:
        """Most tokens of a re-templated conversation (None: no limit)."""
        return self.rollout.max_input_tokens if self.serves_in_reward_loop else self.max_length

    @property
    def num_pool_processes(self) -> int:
        """Processes of the reward model's own pool (0 when it shares the actor's)."""
        return self.nnodes * self.n_gpus_per_node if self.enable_resource_pool else 0

    def engine_config(self) -> FSDPEngineConfig:
        """The reward model's inference engine (validation calls it before Ray)."""
        return FSDPEngineConfig(
            model=self.model, fsdp=self.serving_fsdp, micro_batch_size_per_gpu=self.micro_batch_size_per_gpu or 1
        )

    def prime_engine_configs(self, total_training_steps: int = -1) -> tuple[FSDPEngineConfig, FSDPEngineConfig]:
        """PRIME's implicit PRM (trained) and its frozen reference (`model.ref_path`, else the PRM's initial weights)."""
        micro_batch = self.micro_batch_size_per_gpu or 1
        prm = FSDPEngineConfig(
            model=self.model, fsdp=self.model.fsdp_config, optim=self.model.optim, micro_batch_size_per_gpu=micro_batch,
            total_training_steps=total_training_steps,
        )
        ref = FSDPEngineConfig(
            model=dataclasses.replace(self.model, path=self.model.ref_path or self.model.path),
            fsdp=self.model.fsdp_config, micro_batch_size_per_gpu=micro_batch,
        )
        return prm, ref


@dataclass(frozen=True, kw_only=True)
class WorkerRuntimeConfig:
    """What the trainer derives for its workers from the rest of the config."""

    total_training_steps: int = -1
    """Trainer steps of the run (the learning-rate schedule's length unless optim sets its own)."""
    seed: int = 1
    """Seed of weights init and sampling (trainer.seed)."""
    num_threads: int = 0
    """torch intra-op threads of this worker; 0 leaves torch's default."""
    collective_timeout_s: Optional[int] = None
    """Seconds a collective of the worker's process group may wait before it fails (actor_rollout_ref.nccl_timeout);
    None: torch's default."""
