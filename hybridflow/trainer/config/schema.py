"""The PPO/GRPO trainer's config: one frozen dataclass per component, verl's key names, each default once.

Worker-facing components (model, actor, rollout, ref, critic) are defined in `hybridflow.workers.config`.

YAML files and command-line overrides only change values. Each class checks its own fields in
`__post_init__`; checks that span components (batch arithmetic, registry names, files) live in
`validate.py`. Fixed choices are `str` fields checked against a tuple: OmegaConf 2.3, which builds
these structured configs, rejects `Literal` annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hybridflow.workers.config import (
    ActorRolloutRefConfig,
    CriticConfig,
    check_choice,
    check_positive,
)


# ----------------------------------------------------------------------------- data
@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where prompts come from and how long prompts and responses may be."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files of training prompts (verl schema: prompt, data_source, reward_model.ground_truth)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files for validation; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template; prompts are left-padded to this length."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per training step (each is sampled actor_rollout_ref.rollout.n times)."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation batch; None takes the whole validation set at once."""
    truncation: str = "error"
    """Prompt longer than max_prompt_length and not filtered: error | left | right | middle."""
    filter_overlong_prompts: bool = True
    """Drop over-long prompts when the dataset is built (counted and logged)."""
    return_raw_chat: bool = False
    """Keep the chat messages per sample (agent loops need them)."""
    shuffle: bool = True
    """Shuffle training prompts (seeded, resumable)."""
    seed: int = 1
    """Seed of the data order."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for tokenizer.apply_chat_template."""

    def __post_init__(self) -> None:
        check_positive("data.train_batch_size", self.train_batch_size)
        check_positive("data.val_batch_size", self.val_batch_size, allow_none=True)
        check_positive("data.max_prompt_length", self.max_prompt_length)
        check_positive("data.max_response_length", self.max_response_length)
        check_choice("data.truncation", self.truncation, ("error", "left", "right", "middle"))


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft penalty for responses near the length limit."""

    enable: bool = False
    """Turn the penalty on."""
    len: int = 0
    """Tokens before max_response_length where the penalty starts."""
    penalty_factor: float = 1.0
    """Penalty at the limit."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """Rule-based reward managers (and, later, model-based reward)."""

    enable: bool = False
    """Use a learned reward model (not supported yet by this trainer)."""
    reward_manager: str = "naive"
    """naive | batch | dapo, or a registered custom manager."""
    timeout_s: float = 10.0
    """A scorer running longer than this scores 0 and is counted in reward/timeouts."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong penalty (reward_manager=dapo)."""

    def __post_init__(self) -> None:
        check_positive("reward_model.timeout_s", self.timeout_s)
        if self.enable:
            raise ValueError(
                "reward_model.enable=True (a learned reward model) is not supported by this trainer yet; "
                "use rule-based rewards (reward_model.enable=False) or custom_reward_function.path"
            )


@dataclass(frozen=True, kw_only=True)
class CustomRewardFunctionConfig:
    """A user scoring function loaded from a file."""

    path: Optional[str] = None
    """Python file defining the function; None uses the built-in scorers by data_source."""
    name: str = "compute_score"
    """Function name in that file."""


# ----------------------------------------------------------------------------- algorithm and trainer
@dataclass(frozen=True, kw_only=True)
class KLControlConfig:
    """Coefficient of the KL-in-reward penalty."""

    type: str = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.001
    """Initial coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target."""

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_ctrl.type", self.type, ("fixed", "adaptive"))


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""

    adv_estimator: str = "gae"
    """A registered estimator: gae | grpo | grpo_passk | rloo | opo | reinforce_plus_plus | remax | gpg | ..."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """False gives Dr.GRPO."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator in the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Penalty coefficient controller."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The run: size, length, logging, validation and checkpoints."""

    project_name: str = "hybridflow"
    """Tracking project."""
    experiment_name: str = "run"
    """Tracking run name."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Any of console, file, tensorboard, wandb, mlflow."""
    nnodes: int = 1
    """Nodes in the Ray cluster used."""
    n_gpus_per_node: int = 1
    """Workers per node: accelerators per node on GPU hosts, CPU workers on CPU hosts."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (None: total_epochs x batches per epoch)."""
    critic_warmup: int = 0
    """Steps that update only the critic."""
    test_freq: int = -1
    """Validate every N steps (-1: only at the end)."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Only validate the loaded policy (logged at step 0), no training."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end if default_local_dir is set)."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoint directory (global_step_N/ below it)."""
    resume_mode: str = "auto"
    """auto (latest checkpoint if any) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint directory for resume_mode=resume_path."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Older checkpoints are deleted beyond this many; None keeps all."""
    log_val_generations: int = 0
    """Validation samples printed per validation."""
    seed: int = 1
    """Seed of model init, sampling and shuffling."""
    device: str = "auto"
    """auto (cuda if present, else cpu) | cpu | cuda."""
    local_mode: bool = False
    """Run workers in the driver process without Ray (debugging; needs n_gpus_per_node=1)."""
    num_threads_per_worker: int = 0
    """torch threads per worker on CPU hosts; 0 divides the cores among the workers."""

    def __post_init__(self) -> None:
        allowed = ("console", "file", "tensorboard", "wandb", "mlflow")
        for name in self.logger:
            check_choice("trainer.logger entry", name, allowed)
        check_positive("trainer.nnodes", self.nnodes)
        check_positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        check_positive("trainer.total_epochs", self.total_epochs)
        check_positive("trainer.total_training_steps", self.total_training_steps, allow_none=True)
        check_choice("trainer.resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        check_choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>")
        if self.local_mode and self.nnodes * self.n_gpus_per_node != 1:
            raise ValueError(
                f"trainer.local_mode=True runs one worker in the driver; set trainer.n_gpus_per_node=1 "
                f"trainer.nnodes=1 (got {self.nnodes} x {self.n_gpus_per_node})"
            )


@dataclass(frozen=True, kw_only=True)
class RayInitConfig:
    """How the driver starts or joins Ray."""

    address: Optional[str] = None
    """Existing cluster address; None starts the embedded local cluster (RAY_ADDRESS also works)."""
    num_cpus: Optional[int] = None
    """CPUs of the embedded cluster; None uses the machine's cores (at least the workers' needs)."""


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The whole trainer config (the root that command-line overrides address)."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
