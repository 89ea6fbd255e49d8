"""The training engine's config: the optimizer and its schedule, FSDP2 sharding, and what one engine is built from.

`OptimConfig` and `FSDPConfig` are the sections verl users know as `actor.optim.*` / `actor.fsdp_config.*`
(also `critic.*`, `ref.fsdp_config`, and `optim.*` / `model.fsdp_config.*` in SFT). `FSDPEngineConfig` only
nests them with the model section; it copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, check_range
from hybridflow.utils.config import unsupported

__all__ = ["FSDPConfig", "FSDPEngineConfig", "FSDPModelConfig", "OptimConfig", "ParallelLayout", "RouterReplayConfig"]


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (AdamW unless `optimizer` names another) and its learning-rate schedule (verl's `optim.*`
    keys)."""

    optimizer: str = "AdamW"
    """Optimizer class in `optimizer_impl` (verl's key), e.g. AdamW, Adam, SGD; checked before Ray starts."""
    optimizer_impl: str = "torch.optim"
    """Module the optimizer class is imported from (verl's key): torch.optim, or an installed package's module such
    as torchao.optim or bitsandbytes.optim."""
    override_optimizer_config: Optional[dict[str, Any]] = None
    """Keyword arguments for the optimizer class, over lr, betas, eps and weight_decay (verl's key), e.g.
    +actor_rollout_ref.actor.optim.override_optimizer_config.fused=False. Checked against the class's signature
    before Ray starts. Unless it names `fused` or `foreach`, a torch optimizer that has a fused kernel for the
    parameters' device runs it (one kernel for all parameters, not a few per tensor)."""
    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Betas of AdamW (and of any optimizer class that takes them)."""
    eps: float = 1e-8
    """Epsilon of AdamW (and of any optimizer class that takes it)."""
    weight_decay: float = 0.01
    """Weight decay (AdamW's is decoupled), for optimizer classes that take it."""
    lr_warmup_steps: Optional[int] = -1
    """Linear warm-up steps; -1 (or None, as verl documents) derives them from lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the schedule's steps (used when lr_warmup_steps is -1)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up: constant, linear decay to min_lr_ratio, or cosine decay to min_lr_ratio."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the linear and cosine schedules as a fraction of lr."""
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still measured and reported)."""
    num_cycles: float = 0.5
    """Waves of the cosine schedule (verl's key): 0.5 decays once from lr to min_lr_ratio * lr; more rise again."""
    total_training_steps: int = -1
    """Length of the schedule in optimizer-schedule steps; -1 takes the trainer's total number of steps."""
    warmup_style: Optional[str] = unsupported(None, "verl renamed it; use lr_scheduler_type")
    """Old name of lr_scheduler_type."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("lr", self.lr, 0.0)
        check_range("lr_warmup_steps_ratio", self.lr_warmup_steps_ratio, 0.0, 1.0, high_open=True)
        check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_at_least("clip_grad", self.clip_grad, 0.0, "0 disables clipping")
        check_at_least("weight_decay", self.weight_decay, 0.0)
        if self.lr_warmup_steps is not None:
            check_at_least("lr_warmup_steps", self.lr_warmup_steps, -1, "-1 derives it from lr_warmup_steps_ratio")
        check_at_least("num_cycles", self.num_cycles, 0.0)
        if self.num_cycles != 0.5 and self.lr_scheduler_type != "cosine":
            raise ConfigFieldError(
                "num_cycles",
                f"num_cycles={self.num_cycles} shapes the cosine schedule only, and lr_scheduler_type="
                f"{self.lr_scheduler_type!r}; set lr_scheduler_type=cosine or drop num_cycles",
            )
        for name in ("optimizer", "optimizer_impl"):
            if not str(getattr(self, name)).replace(".", "").replace("_", "").isalnum():
                raise ConfigFieldError(name, f"{name}={getattr(self, name)!r} is not a Python name")
        for index, beta in enumerate(self.betas):
            check_range(f"betas[{index}]", beta, 0.0, 1.0, high_open=True)

    @property
    def is_default_optimizer(self) -> bool:
        """torch.optim.AdamW with no overrides: known to take these arguments, so checking it needs no import."""
        return (
            self.optimizer_impl == "torch.optim" and self.optimizer == "AdamW" and not self.override_optimizer_config
        )

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warm-up length in scheduler steps, from `lr_warmup_steps` or the ratio of `total_steps`."""
        if self.lr_warmup_steps is not None and self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * max(total_steps, 0))

    def schedule_steps(self, trainer_total_steps: int) -> int:
        """The schedule's length: `total_training_steps` when set, else the trainer's total."""
        return self.total_training_steps if self.total_training_steps > 0 else trainer_total_steps


_PRECISION_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                    "fp32": "float32", "float32": "float32"}
"""verl's precision names (PrecisionType) -> torch's."""


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """How a model is sharded (FSDP2) and what is offloaded (verl's `fsdp_config.*` keys)."""

    param_offload: bool = False
    """Keep sharded parameters and gradients on the CPU (FSDP2 CPUOffloadPolicy; the optimizer step runs there). A
    lone GPU rank joins a one-rank process group for it."""
    optimizer_offload: bool = False
    """Move optimizer state to the CPU between updates."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2, faster)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of parameters in forward/backward: auto is bfloat16 on GPU, float32 on CPU (bfloat16 everywhere
    with model_dtype=bfloat16). Master weights and optimizer state are in model_dtype."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter."""
    model_dtype: Literal["fp32", "float32", "bf16", "bfloat16"] = "fp32"
    """Dtype the weights are loaded, trained and saved in (verl's key). fp32: float32 master weights and optimizer
    state, computing in `dtype`. bfloat16: the weights, their gradients and AdamW's moments are bfloat16 (half the
    memory of each; updates smaller than a weight's bf16 spacing are lost), computing in bfloat16."""
    tensor_parallel_size: int = 1
    """Ranks that split each layer's heads, MLP and vocabulary (DTensor tensor parallel, Llama/Qwen2 family); FSDP2
    then shards over the remaining data-parallel ranks."""
    expert_parallel_size: int = 1
    """MoE models: ranks that split each layer's routed experts (each holds E / ep whole experts; tokens reach them
    by all-to-all). The ranks of an EP group still take different data; FSDP2 shards each rank's experts over the
    world / ep ranks that hold the same ones. Needs a model whose experts it divides (transformers' EP plan)."""
    fsdp_size: int = -1
    """Ranks per FSDP sharding group (-1, or the ranks or more: all ranks, as verl reads it). A smaller divisor k of
    the ranks gives hybrid sharding (HSDP, verl's key): each group of k consecutive ranks shards the weights, the
    world / k groups are replicas of each other, and gradients are reduce-scattered in a group, then all-reduced over
    the replicas. Not with tensor or expert parallelism."""
    offload_policy: bool = unsupported(False, "use param_offload, which applies FSDP2's CPUOffloadPolicy")
    """FSDP2 CPU offload of parameters, gradients and optimizer state."""
    mixed_precision: dict[str, str] = field(default_factory=dict)
    """verl's FSDP mixed-precision dict (set as `+fsdp_config.mixed_precision.param_dtype=bf16`): param_dtype
    (verl's default when the dict is given: bf16) sets `dtype`, reduce_dtype (default fp32) sets `reduce_dtype`,
    and buffer_dtype must be the weights' dtype (FSDP2 keeps buffers in it; verl's FSDP2 path ignores the key).
    Empty: `dtype` and `reduce_dtype` as set."""
    forward_prefetch: bool = False
    """Issue each decoder layer's parameter all-gather while the layer before it computes, in forward (FSDP2's
    explicit prefetch, `set_modules_to_forward_prefetch`; verl's FSDP1 key). It overlaps communication with compute
    where the all-gathers are exposed (many ranks, slow links), at the memory of one more gathered layer. The
    result is the same bit for bit. A lone rank without a process group shards nothing and gathers nothing."""
    strategy: Literal["fsdp", "fsdp2"] = "fsdp"
    """verl's engine-config copy of the section's strategy: fsdp and fsdp2 both shard with FSDP2 here."""
    forward_only: Optional[bool] = None
    """verl's engine-config copy of whether the role trains (False: actor, critic) or only runs forwards (True:
    reference); hybridflow decides it by role, and refuses a value that contradicts the role."""
    seed: int = unsupported(42, "the engines are seeded by trainer.seed")
    """verl: its new engine's seed."""
    ulysses_sequence_parallel_size: int = unsupported(
        1, "set the role's own key (e.g. actor_rollout_ref.actor.ulysses_sequence_parallel_size)"
    )
    """verl's engine-config copy of the role's ulysses_sequence_parallel_size."""
    entropy_checkpointing: bool = unsupported(
        False, "set the role's own key (e.g. actor_rollout_ref.actor.entropy_checkpointing)"
    )
    """verl's engine-config copy of the role's entropy_checkpointing."""
    entropy_from_logits_with_chunking: bool = unsupported(
        False, "set the role's own key (e.g. actor_rollout_ref.actor.entropy_from_logits_with_chunking)"
    )
    """verl's engine-config copy of the role's entropy_from_logits_with_chunking."""
    use_torch_compile: bool = unsupported(False, "the training engine runs eagerly (as actor.use_torch_compile says)")
    """verl's engine-config copy of torch.compile for its new engine's helpers (verl's default True)."""
    use_orig_params: bool = False
    """verl's FSDP1 choice between flat and per-parameter sharding. FSDP2 shards each original parameter, which is
    what True asks of FSDP1; both values run that way."""
    wrap_policy: dict[str, Any] = unsupported(
        {"min_num_params": 0}, "FSDP2 wraps each decoder layer and the root module; size-based wrapping is not built"
    )
    """verl: FSDP1's auto-wrap policy."""
    full_determinism: bool = unsupported(False, "deterministic kernels (torch.use_deterministic_algorithms) are not set")
    """verl: run torch's deterministic algorithms only."""

    def __post_init__(self) -> None:
        if self.mixed_precision:
            self._take_mixed_precision()
        check_literal_fields(self)
        check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_at_least("expert_parallel_size", self.expert_parallel_size, 1)
        if self.fsdp_size != -1:
            check_positive("fsdp_size", self.fsdp_size)
            for other in ("tensor_parallel_size", "expert_parallel_size"):
                if getattr(self, other) > 1:
                    raise ConfigFieldError(
                        "fsdp_size",
                        f"fsdp_size={self.fsdp_size} with {other}={getattr(self, other)}: hybrid sharding groups "
                        f"with {other.split('_')[0]} parallelism are not implemented; use fsdp_size=-1 or {other}=1",
                    )
        if self.weight_dtype != "float32" and self.dtype not in ("auto", self.weight_dtype):
            raise ConfigFieldError(
                "dtype",
                f"dtype={self.dtype!r} with model_dtype={self.model_dtype!r}: the weights are {self.weight_dtype}, "
                f"so they compute in it; set dtype=auto (or {self.weight_dtype}), or model_dtype=fp32",
            )
        if self.expert_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ConfigFieldError(
                "expert_parallel_size",
                f"expert_parallel_size={self.expert_parallel_size} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: combining expert and tensor parallelism is not implemented; use one",
            )
        if self.expert_parallel_size > 1 and self.param_offload:
            raise ConfigFieldError(
                "param_offload",
                f"param_offload=True with expert_parallel_size={self.expert_parallel_size}: offloading expert-parallel "
                "shards is not implemented; turn one of them off",
            )
        if self.tensor_parallel_size > 1 and self.param_offload:
            raise ConfigFieldError(
                "param_offload",
                f"param_offload=True with tensor_parallel_size={self.tensor_parallel_size}: offloading tensor-parallel "
                "shards is not implemented; turn one of them off",
            )

    def _take_mixed_precision(self) -> None:
        """verl's `mixed_precision` dict into `dtype` / `reduce_dtype`; a value that contradicts them is refused."""
        unknown = sorted(set(self.mixed_precision) - {"param_dtype", "reduce_dtype", "buffer_dtype"})
        if unknown:
            raise ConfigFieldError("mixed_precision", f"mixed_precision has unknown keys {unknown}; verl's are "
                                                      "param_dtype, reduce_dtype and buffer_dtype")
        names = {}
        for key, value in self.mixed_precision.items():
            if str(value) not in _PRECISION_NAMES:
                raise ConfigFieldError("mixed_precision", f"mixed_precision.{key}={value!r} is not one of "
                                                          f"{sorted(_PRECISION_NAMES)}")
            names[key] = _PRECISION_NAMES[str(value)]
        param, reduce = names.get("param_dtype", "bfloat16"), names.get("reduce_dtype", "float32")
        buffer = names.get("buffer_dtype", self.weight_dtype)
        if self.dtype not in ("auto", param):
            raise ConfigFieldError("mixed_precision", f"mixed_precision.param_dtype={param!r} with dtype={self.dtype!r}: "
                                                      "both set the compute dtype; set one")
        if reduce not in ("float32", "bfloat16") or self.reduce_dtype not in ("float32", reduce):
            raise ConfigFieldError("mixed_precision", f"mixed_precision.reduce_dtype={reduce!r} with reduce_dtype="
                                                      f"{self.reduce_dtype!r}: gradients reduce in float32 or bfloat16, "
                                                      "set by one of the two keys")
        if buffer != self.weight_dtype:
            raise ConfigFieldError("mixed_precision", f"mixed_precision.buffer_dtype={buffer!r}: FSDP2 keeps buffers "
                                                      f"in the weights' dtype ({self.weight_dtype}, model_dtype); "
                                                      "drop buffer_dtype or set it to that")
        object.__setattr__(self, "dtype", param)
        object.__setattr__(self, "reduce_dtype", reduce)

    @property
    def weight_dtype(self) -> str:
        """The weights' dtype as torch names it: float32 or bfloat16."""
        return "float32" if self.model_dtype in ("fp32", "float32") else "bfloat16"

    @property
    def compute_dtype(self) -> str:
        """The forward/backward dtype setting: `dtype`, where auto follows bfloat16 weights."""
        return self.weight_dtype if self.dtype == "auto" and self.weight_dtype != "float32" else self.dtype


@dataclass(frozen=True, kw_only=True)
class FSDPModelConfig(ModelConfig):
    """A model section that carries its own sharding (verl's `critic.model.*` and SFT's `model.*`)."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, precision and offload of this model."""


@dataclass(frozen=True, kw_only=True)
class FSDPEngineConfig:
    """Everything one training engine is built from: the model section, sharding, optimizer, micro-batching."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and its LoRA, gradient-checkpointing and padding-removal settings."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, precision and offload."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    micro_batch_size_per_gpu: int = 1
    """Sequences per forward/backward on one rank; gradients are accumulated over micro-batches."""
    total_training_steps: int = -1
    """Trainer steps of the run (the schedule's length unless optim.total_training_steps is set); -1: unknown."""
    share_prompts: bool = False
    """Rows of a micro-batch with the same prompt share one copy of it in the forward (a packed row with a block
    mask): the same log-probs, values and gradients, with each prompt computed once per group."""

    ulysses_sequence_parallel_size: int = 1
    """Ranks that split each packed row (Ulysses all-to-all around attention); needs use_remove_padding."""
    freeze_vision_tower: bool = False
    """A vision-language model: keep its vision tower's weights as loaded (no gradients, no optimizer state)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size, 1)
        if self.ulysses_sequence_parallel_size > 1:
            if not self.model.use_remove_padding:
                raise ConfigFieldError(
                    "ulysses_sequence_parallel_size",
                    f"ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} splits packed rows; set "
                    "model.use_remove_padding=True",
                )
            if self.share_prompts:
                raise ConfigFieldError(
                    "ulysses_sequence_parallel_size",
                    "sequence parallelism with shared-prompt forwards (use_prefix_grouper) is not implemented; turn "
                    "one of them off",
                )
            if self.attn_implementation not in ("sdpa", "eager"):
                raise ConfigFieldError(
                    "ulysses_sequence_parallel_size",
                    "Ulysses attention wraps sdpa or eager, not "
                    f"model.override_config.attn_implementation={self.attn_implementation!r}",
                )
        if self.attn_implementation == "flash_attention_2" and self.share_prompts:
            raise ConfigFieldError(
                "model.override_config.attn_implementation",
                "shared-prompt forwards (use_prefix_grouper) need a block attention mask, which flash_attention_2 "
                "cannot take; use sdpa, eager or flex_attention, or turn use_prefix_grouper off",
            )
        if self.fsdp.expert_parallel_size > 1 and self.model.lora_target_parameters:
            raise ConfigFieldError(
                "expert_parallel_size",
                "LoRA on the experts (model.target_parameters) with expert_parallel_size > 1 is not implemented (each "
                "rank holds part of the experts); use expert_parallel_size=1, or adapters on the attention only",
            )
        if self.fsdp.tensor_parallel_size > 1 and self.model.use_lora:
            raise ConfigFieldError(
                "tensor_parallel_size",
                "LoRA adapters with tensor_parallel_size > 1 are not implemented; use tensor_parallel_size=1 with LoRA",
            )
        check_at_least("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, 1)
        steps = self.optim.schedule_steps(self.total_training_steps)
        if self.optim.lr_scheduler_type != "constant" and steps <= 0:
            raise ConfigFieldError(
                "optim.lr_scheduler_type",
                f"optim.lr_scheduler_type={self.optim.lr_scheduler_type!r} needs the number of training steps; set "
                "optim.total_training_steps or use lr_scheduler_type=constant",
            )
        if self.optim.lr_warmup_steps < 0 and self.optim.lr_warmup_steps_ratio > 0 and steps <= 0:
            raise ConfigFieldError(
                "optim.lr_warmup_steps_ratio",
                f"optim.lr_warmup_steps_ratio={self.optim.lr_warmup_steps_ratio} needs the number of training steps; "
                "set optim.total_training_steps or give optim.lr_warmup_steps",
            )

    @property
    def attn_implementation(self) -> str:
        """The model's attention kernel (model.override_config.attn_implementation)."""
        return self.model.attn_implementation

    @property
    def schedule_steps(self) -> int:
        """Length of the learning-rate schedule."""
        return self.optim.schedule_steps(self.total_training_steps)


@dataclass(frozen=True)
class ParallelLayout:
    """How `world_size` ranks split into data (`dp`), tensor (`tp`) and sequence (`sp`) parallel groups, and
    (MoE) expert-parallel groups of `ep` ranks, which take different data and split the experts."""

    world_size: int
    tp: int = 1
    sp: int = 1
    ep: int = 1
    fsdp_size: int = -1
    """Ranks per FSDP2 sharding group (hybrid sharding when it is a divisor below the world; -1: all)."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.sp < 1:
            raise ValueError(f"tensor and sequence parallel sizes must be >= 1, got tp={self.tp} sp={self.sp}")
        if self.tp > 1 and self.sp > 1:
            raise ValueError(
                f"tensor_parallel_size={self.tp} with ulysses_sequence_parallel_size={self.sp}: combining them is "
                "not implemented; use one of the two"
            )
        if self.ep < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.ep}")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(
                f"expert_parallel_size={self.ep} with tensor_parallel_size={self.tp}: combining them is not "
                "implemented; use one (expert parallelism composes with ulysses_sequence_parallel_size)"
            )
        if self.world_size % self.ep:
            raise ValueError(
                f"{self.world_size} ranks cannot form expert-parallel groups of expert_parallel_size={self.ep}; the "
                "number of ranks must be a multiple of it"
            )
        if self.world_size % (self.tp * self.sp):
            raise ValueError(
                f"{self.world_size} ranks cannot form groups of tensor_parallel_size x ulysses_sequence_parallel_size "
                f"= {self.tp * self.sp}; the number of ranks must be a multiple of it"
            )
        if self.fsdp_size != -1 and (self.fsdp_size < 1 or (self.hybrid_shards and self.world_size % self.fsdp_size)):
            raise ValueError(
                f"fsdp_size={self.fsdp_size} does not divide the {self.world_size} ranks into sharding groups; use a "
                "divisor of the ranks, or -1 (one group of all ranks)"
            )

    @property
    def hybrid_shards(self) -> bool:
        """Whether FSDP2 shards in groups of fsdp_size ranks replicated over the rest (HSDP). An fsdp_size of all the
        ranks or more is one group of all of them, as in verl (a line written for 8 GPUs runs on fewer)."""
        return self.fsdp_size != -1 and self.fsdp_size < self.world_size

    @property
    def group_size(self) -> int:
        """Ranks that share one data shard (tp x sp)."""
        return self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel groups: distinct data shards per step."""
        return self.world_size // self.group_size

    def dp_rank(self, rank: int) -> int:
        """The data shard rank `rank` takes."""
        return rank // self.group_size

    def is_collect(self, rank: int) -> bool:
        """Whether rank `rank`'s output is kept (one per data-parallel group)."""
        return rank % self.group_size == 0

    @property
    def sharding_group_size(self) -> int:
        """Ranks one FSDP2 sharding group spans: fsdp_size under hybrid sharding, else all of them."""
        return self.fsdp_size if self.hybrid_shards else self.world_size

    def record(self) -> dict[str, int]:
        """What a checkpoint's `layout.json` records of the layout its shards were cut for."""
        return {
            "tensor_parallel_size": self.tp, "ulysses_sequence_parallel_size": self.sp,
            "expert_parallel_size": self.ep, "fsdp_size": self.sharding_group_size, "world_size": self.world_size,
        }

    def shard_mismatch(self, saved: dict[str, int]) -> str | None:
        """The first setting whose saved value (a `record()`) cuts other shards than this layout's, as
        'key=saved, this run uses N'; None where the shards fit (sequence parallelism does not cut them)."""
        record = self.record()
        for key in ("world_size", "tensor_parallel_size", "expert_parallel_size", "fsdp_size"):
            used = record[key]
            was = saved.get(key, self.world_size if key == "world_size" else 1)
            if was != used:
                return f"{key}={was}, this run uses {used}"
        return None


@dataclass(frozen=True, kw_only=True)
class RouterReplayConfig:
    """Router replay for MoE models (verl's `actor.router_replay`): R3 trains with the experts the rollout chose."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"
    """disabled: the training forward routes by itself. R3 (rollout routing replay): every training and log-prob
    forward routes each token to the experts the rollout recorded (needs rollout.enable_rollout_routing_replay).
    R2 (replaying the old-log-prob forward's routing) is not implemented."""
    record_file: Optional[str] = None
    """verl's file of recorded routing: not used, the routing travels in the batch (`routed_experts`)."""
    replay_file: Optional[str] = None
    """verl's file of routing to replay: not used, the routing travels in the batch (`routed_experts`)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.mode == "R2":
            raise ConfigFieldError(
                "mode", "mode='R2' (replaying the old-log-prob forward's routing) is not implemented; use mode=R3 "
                "with rollout.enable_rollout_routing_replay=True, or mode=disabled",
            )
        for name in ("record_file", "replay_file"):
            if getattr(self, name) is not None:
                raise ConfigFieldError(
                    name, f"{name}={getattr(self, name)!r}: routing is carried in the batch (routed_experts), not in "
                    "files; leave it unset",
                )
