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
from hybridflow.engines.rollout.config import DEFAULT_BUCKET_MEGABYTES, RolloutConfig
from hybridflow.engines.training.config import (
    FSDPConfig,
    FSDPEngineConfig,
    FSDPModelConfig,
    OptimConfig,
    RouterReplayConfig,
)
from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import (
    ROWS_UNREAD, ConfigFieldError, check_at_least, check_literal_fields, check_micro_batch, check_positive, unsupported,
)
from hybridflow.utils.profiler_config import RoleProfilerConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "CheckpointConfig",
    "CriticConfig",
    "RefConfig",
    "RefFSDPConfig",
    "RefModelConfig",
    "WorkerRuntimeConfig",
]

Strategy = Literal["fsdp", "fsdp2"]
"""Both names run FSDP2 (`fully_shard`); verl's FSDP1 path does not exist here."""


CheckpointPart = Literal["model", "optimizer", "extra", "hf_model"]
HF_MODEL_DIR = "huggingface_full"
"""Where a checkpoint's full HF copy of the weights goes (`hf_model`), beside the shards in the role's directory."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What a role's checkpoint holds, and what a resumed run reads of it (verl's keys)."""

    save_contents: list[CheckpointPart] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Parts to save: model (the weight shards), optimizer (its state), extra (LR scheduler, RNG), hf_model (a full
    HF directory of the weights, `huggingface_full/`, loadable by transformers and as a model.path). Without all
    of model, optimizer and extra a checkpoint cannot resume exactly: ['hf_model'] alone saves exports only."""
    async_save: bool = unsupported(False, "checkpoints are written in the step, staged and renamed atomically")
    """verl: write checkpoints in the background."""
    load_contents: Optional[list[CheckpointPart]] = None
    """Parts a resumed run reads (None: save_contents, verl's default). The model is always read (without it the
    run would claim step N with its initial weights), so a checkpoint without its shards cannot be resumed; without
    optimizer or extra those restart fresh (AdamW moments, the LR schedule from its start). hf_model reads
    nothing: the export is not training state."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        for name in ("save_contents", "load_contents"):
            parts = getattr(self, name)
            if parts is not None and (not parts or len(set(parts)) != len(parts)):
                raise ConfigFieldError(name, f"{name}={parts} must name each part once and at least one")
        if self.load_contents is not None and "model" not in self.load_contents:
            raise ConfigFieldError(
                "load_contents",
                f"load_contents={self.load_contents} leaves out model: a resumed run would continue at the "
                "checkpoint's step with its initial weights; add model (or set trainer.resume_mode=disable)",
            )

    @property
    def engine_parts(self) -> tuple[str, ...]:
        """The training engine's parts to save (`engine_state.ENGINE_PARTS` order)."""
        return tuple(part for part in ("model", "optimizer", "extra") if part in self.save_contents)

    @property
    def resume_parts(self) -> tuple[str, ...]:
        """The engine's parts a resumed run reads: the model always, and optimizer / extra where load_contents
        (else save_contents) lists them."""
        parts = self.save_contents if self.load_contents is None else self.load_contents
        return ("model", *(part for part in ("optimizer", "extra") if part in parts))

    @property
    def saves_hf_model(self) -> bool:
        return "hf_model" in self.save_contents


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
    ppo_micro_batch_size_per_gpu: Optional[int] = 4
    """Samples per forward/backward on one rank (gradient accumulation fills the mini-batch); null (verl's default)
    only with use_dynamic_bsz, whose token budget cuts the micro-batches."""
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
    calculate_sum_pi_squared: bool = False
    """The old-log-prob pass also returns each response position's sum of squared probabilities, sum_v pi_v^2
    (`sum_pi_squared`, under the log-prob temperature): the optimal_token_baseline estimators read it, and the
    variance_proxy/* metrics are logged from it. Forces the separate old-log-prob pass."""
    sum_pi_squared_checkpointing: bool = False
    """verl: recompute sum(pi^2) in the update's backward instead of keeping its logits. Here sum(pi^2) is
    computed only in the no-grad old-log-prob pass, which keeps nothing for a backward: the memory it saves in verl
    is never spent. Needs calculate_sum_pi_squared=True."""
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
    calculate_entropy: bool = False
    """Also compute the policy's entropy in the update's forwards (verl's key; always with entropy_coeff != 0):
    actor/entropy is then the updated samples' mean entropy under the policy being trained."""
    data_loader_seed: int = unsupported(42, "the update's mini-batch shuffle is seeded by trainer.seed and the step")
    """verl: seed of its new worker's mini-batch loader."""
    rollout_n: Optional[int] = None
    """verl's copy of actor_rollout_ref.rollout.n (derived from it); set rollout.n instead."""
    use_remove_padding: Optional[bool] = None
    """verl's copy of actor_rollout_ref.model.use_remove_padding (derived from it); set that key instead."""
    use_fused_kernels: Optional[bool] = None
    """verl's copy of actor_rollout_ref.model.use_fused_kernels (derived from it); set that key instead."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_micro_batch("ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu, "use_dynamic_bsz",
                          self.use_dynamic_bsz)
        check_positive("ppo_max_token_len_per_gpu", self.ppo_max_token_len_per_gpu)
        check_positive("ppo_epochs", self.ppo_epochs)
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        _check_clip(self.grad_clip, self.optim)
        if self.sum_pi_squared_checkpointing and not self.calculate_sum_pi_squared:
            raise ConfigFieldError(
                "sum_pi_squared_checkpointing",
                "sum_pi_squared_checkpointing=True with calculate_sum_pi_squared=False: nothing computes sum(pi^2) "
                "to checkpoint; set calculate_sum_pi_squared=True or drop it",
            )

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
            micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu or ROWS_UNREAD,
            total_training_steps=total_training_steps,
            share_prompts=self.use_prefix_grouper,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
            freeze_vision_tower=self.freeze_vision_tower,
        )


@dataclass(frozen=True, kw_only=True)
class RefFSDPConfig(FSDPConfig):
    """The reference's sharding (`actor_rollout_ref.ref.fsdp_config.*`): the actor's keys, less what needs an
    optimizer."""

    optimizer_offload: bool = unsupported(False, "the reference is frozen and has no optimizer to offload (the "
                                          "actor's is actor_rollout_ref.actor.fsdp_config.optimizer_offload)")
    """verl: move the optimizer state to the CPU between updates; the reference has none."""


@dataclass(frozen=True, kw_only=True)
class RefModelConfig(ModelConfig):
    """The reference's weights (`actor_rollout_ref.ref.model.*`); `path=None` means the actor's model as it is."""

    path: Optional[str] = None
    """Reference (teacher) checkpoint: None, or the actor's path, is the actor's initial model."""

    def __post_init__(self) -> None:
        if self.path is not None:
            super().__post_init__()
        for name in ("lora_rank", "lora_adapter_path", "enable_gradient_checkpointing", "enable_activation_offload"):
            if getattr(self, name):
                raise ConfigFieldError(
                    name, f"{name}={getattr(self, name)!r}: the reference is frozen, leave it unset (a LoRA actor's "
                    "reference is its base model already)"
                )
        if self.custom_chat_template is not None:
            raise ConfigFieldError(
                "custom_chat_template", "custom_chat_template: the reference scores the policy's token ids and renders "
                "no chat; the actor's template (actor_rollout_ref.model.custom_chat_template) renders the prompts"
            )
        if self.use_shm:
            raise ConfigFieldError(
                "use_shm", "use_shm=True: only the actor's model is copied to /dev/shm (actor_rollout_ref.model."
                "use_shm, which a reference of the same model reads too); a teacher loads from its path; leave it unset"
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
    log_prob_micro_batch_size_per_gpu: Optional[int] = 8
    """Samples per forward when computing reference log-probs (the PPO trainer sets it from
    rollout.log_prob_micro_batch_size_per_gpu unless given; 8 applies to a reference built on its own); null only
    with log_prob_use_dynamic_bsz."""
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
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    """Sharding of the reference model."""
    model: RefModelConfig = field(default_factory=lambda: RefModelConfig())
    """Reference weights: the actor's model unless set. Another checkpoint with the policy's tokenizer is a
    teacher: actor.use_kl_loss / algorithm.use_kl_in_reward then give on-policy distillation (the per-token
    reverse KL of the policy's own samples to the teacher)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the reference (see global_profiler)."""
    rollout_n: Optional[int] = None
    """verl's copy of actor_rollout_ref.rollout.n (derived from it); set rollout.n instead."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """verl's reference router replay. The reference's forwards replay the rollout's experts exactly when the
    actor's do (actor.router_replay.mode=R3, the batch carries them); R3 here without it is refused."""

    def __post_init__(self) -> None:
        check_micro_batch("log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu,
                          "log_prob_use_dynamic_bsz", self.log_prob_use_dynamic_bsz)
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
            micro_batch_size_per_gpu=self.log_prob_micro_batch_size_per_gpu or ROWS_UNREAD,
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
        bucket_mb = self.rollout.checkpoint_engine.update_weights_bucket_megabytes
        if self.hybrid_engine and bucket_mb != DEFAULT_BUCKET_MEGABYTES:
            raise ConfigFieldError(
                "rollout.checkpoint_engine.update_weights_bucket_megabytes",
                f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb} with "
                "actor_rollout_ref.hybrid_engine=True: a colocated rollout takes the weights in memory, tensor by "
                f"tensor, with no transfer to bucket; leave it at {DEFAULT_BUCKET_MEGABYTES}, or split the pools "
                "(hybrid_engine=False), whose broadcast it sizes",
            )
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
    ppo_micro_batch_size_per_gpu: Optional[int] = 4
    """Samples per forward/backward on one rank; null only with use_dynamic_bsz."""
    ppo_micro_batch_size: Optional[int] = None
    """verl's old global form of ppo_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    forward_micro_batch_size_per_gpu: Optional[int] = 8
    """Samples per forward when computing values; null only with use_dynamic_bsz."""
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
    data_loader_seed: int = unsupported(42, "the update's mini-batch shuffle is seeded by trainer.seed and the step")
    """verl: seed of its new worker's mini-batch loader."""
    rollout_n: Optional[int] = None
    """verl's copy of actor_rollout_ref.rollout.n (derived from it); set rollout.n instead."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the critic (see global_profiler)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        for name in ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"):
            check_micro_batch(name, getattr(self, name), "use_dynamic_bsz", self.use_dynamic_bsz)
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
            micro_batch_size_per_gpu=self.ppo_micro_batch_size_per_gpu or ROWS_UNREAD,
            total_training_steps=total_training_steps,
            share_prompts=self.use_prefix_grouper,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )


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
    registrations: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Entries the driver registered itself (a custom policy loss, engine or rollout), pickled: the worker
    installs them before it builds anything (`workers.registrations`)."""
