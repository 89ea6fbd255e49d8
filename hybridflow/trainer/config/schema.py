"""The trainers' root configs: they nest each component's own section under verl's keys and define nothing twice.

Components own their sections (`data`, `algorithms`, `models`, `engines`, `rewards`, `workers`); this module
adds only what belongs to a run (`trainer.*`, `ray_kwargs.*`) and `PPO_DERIVED`, verl's interpolations: keys
whose default is another key's value (the critic's mini-batch defaults to the actor's, the rollout's lengths
to `data.*`), so a user who sets one gets both. YAML files and overrides only change values.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from hybridflow import env

from hybridflow.algorithms.config import AlgorithmConfig
from hybridflow.algorithms.estimator_registry import EstimatorSpec, estimator_spec
from hybridflow.data.config import RLHFDataConfig, SFTDataConfig, expand_path
from hybridflow.engines.training.config import FSDPEngineConfig, FSDPModelConfig, OptimConfig
from hybridflow.rewards.config import CustomRewardFunctionConfig, RewardModelConfig
from hybridflow.trainer import checkpoint_dirs
from hybridflow.trainer.config.async_schema import AsyncTrainingConfig, RolloutPoolConfig
from hybridflow.trainer.guards.config import GuardsConfig
from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, unsupported
from hybridflow.utils.profiler_config import PROFILED_SECTIONS, GlobalProfilerConfig
from hybridflow.workers.config import ActorRolloutRefConfig, CheckpointConfig, CriticConfig, Strategy
from hybridflow.workers.reward_config import RewardModelWorkerConfig

__all__ = [
    "OldLogProbSource",
    "PPOConfig",
    "PPO_DERIVED",
    "PPOTrainerConfig",
    "RayInitConfig",
    "RayKwargsConfig",
    "RewardSectionConfig",
    "RunConfig",
    "SFTConfig",
    "SFTTrainerConfig",
]

Logger = Literal["console", "file", "tensorboard", "wandb", "mlflow"]
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each tracking backend imports."""
OldLogProbSource = Literal["recompute", "update", "rollout"]


# ----------------------------------------------------------------------------- a run
@dataclass(frozen=True, kw_only=True)
class WorkerPlacement:
    """Where a job's worker ranks run and how they are seeded and timed (the `trainer` section of the trainers and
    of `hybridflow generate`)."""

    nnodes: int = 1
    """Nodes in the Ray cluster used."""
    n_gpus_per_node: int = 1
    """Workers per node: accelerators per node on GPU hosts, CPU workers on CPU hosts."""
    seed: int = 1
    """Seed of model init, sampling and shuffling."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda if present, else cpu) | cpu | cuda."""
    local_mode: bool = False
    """Run the one worker in the driver process without Ray (debugging; needs n_gpus_per_node=1, nnodes=1)."""
    num_threads_per_worker: int = 0
    """torch threads per worker on CPU hosts; 0 divides the cores among the workers."""
    rpc_timeout_s: Optional[float] = 3600.0
    """Seconds the driver waits for every rank of one worker-group call (generate, update, save...); past it the run
    stops naming the group, the method and the ranks that did not answer (a hung rank or collective). Raise it for
    calls that are really this slow; None waits forever. Local mode has no limit."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("nnodes", self.nnodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_at_least("num_threads_per_worker", self.num_threads_per_worker, 0)
        check_positive("rpc_timeout_s", self.rpc_timeout_s, allow_none=True)
        if self.local_mode and self.world_size != 1:
            raise ConfigFieldError(
                "local_mode",
                f"local_mode=True runs one worker in the driver; set n_gpus_per_node=1 nnodes=1 "
                f"(got {self.nnodes} x {self.n_gpus_per_node})",
            )

    @property
    def world_size(self) -> int:
        """Ranks (nnodes x n_gpus_per_node)."""
        return self.nnodes * self.n_gpus_per_node

    def joins_cluster(self, ray_address: str | None) -> bool:
        """Whether the workers run on a Ray cluster given by address (ray_kwargs.ray_init.address or RAY_ADDRESS),
        not in this process (local mode) or on the embedded cluster this machine starts."""
        return not self.local_mode and bool(ray_address or env.ray_address())

    def workers_on_cpu(self, ray_address: str | None) -> bool:
        """Whether the workers certainly run on CPU: `device=cpu`, or `device=auto` where they run in this
        process (local mode) or on the embedded cluster of a machine without accelerators. A cluster given by
        address is known only once joined (False here)."""
        if self.device == "cpu":
            return True
        if self.device == "cuda" or self.joins_cluster(ray_address):
            return False
        from hybridflow.utils.device import device_count  # imports torch: only the checks that need it call this

        return device_count() == 0


@dataclass(frozen=True, kw_only=True)
class RunConfig(WorkerPlacement):
    """What every trainer's run has: its name, logging, size, length, checkpoints and placement."""

    project_name: str = "hybridflow"
    """Tracking project."""
    experiment_name: str = "run"
    """Tracking run name."""
    logger: list[Logger] = field(default_factory=lambda: ["console"])
    """Where metrics go: any of console, file, tensorboard, wandb, mlflow (one name or a list). wandb logs
    offline under the run directory (for `wandb sync`) unless WANDB_MODE is set or an API key is at hand."""
    wandb_proxy: Optional[str] = None
    """The HTTPS proxy wandb reaches its server through (verl's `+trainer.wandb_proxy`, wandb's
    Settings(https_proxy)); only with wandb in trainer.logger."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (None: total_epochs x batches per epoch)."""
    test_freq: int = -1
    """Validate every N steps and at the last step (-1: never during training, as in verl; `val_before_train`
    still validates before the first step)."""
    val_before_train: bool = True
    """Validate before the first step."""
    save_freq: int = -1
    """Checkpoint every N steps and at the last step (-1: no checkpoints, as in verl; a guard that stops the run
    still saves its step)."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoints (global_step_N/) and metrics of the run (`~` is expanded)."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto (latest checkpoint in default_local_dir, if any) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """A global_step_N directory for resume_mode=resume_path (`~` is expanded)."""
    use_legacy_worker_impl: Literal["auto", "enable", "disable"] = "auto"
    """verl's switch between its two worker implementations; hybridflow has one, which every value runs."""
    heartbeat_timeout_s: Optional[float] = 60.0
    """Before each step every worker process must answer a ping within this many seconds, else the run stops naming
    it (dead, hung or stopped between calls); logged as workers/alive. None: no heartbeat."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("total_epochs", self.total_epochs)
        check_positive("total_training_steps", self.total_training_steps, allow_none=True)
        check_positive("heartbeat_timeout_s", self.heartbeat_timeout_s, allow_none=True)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigFieldError("resume_mode", "resume_mode=resume_path needs resume_from_path=<global_step_N dir>")
        if self.wandb_proxy is not None and "wandb" not in self.logger:
            raise ConfigFieldError("wandb_proxy", f"wandb_proxy={self.wandb_proxy!r} is wandb's proxy, but logger="
                                                  f"{list(self.logger)} has no wandb: add it, or drop wandb_proxy")

    def local_dir(self) -> Path:
        """`default_local_dir` as a path: `~` expanded, and the default's `${trainer.project_name}` and
        `${trainer.experiment_name}` filled from this section when no Hydra/OmegaConf resolution did it (a RunConfig
        built in Python), so such a run never writes to a directory literally named `${trainer.project_name}`."""
        path = self.default_local_dir
        for name in ("project_name", "experiment_name"):
            path = path.replace("${trainer.%s}" % name, str(getattr(self, name)))
        if "${" in path:
            raise ConfigFieldError("default_local_dir", f"default_local_dir={self.default_local_dir!r} holds an "
                                                        "interpolation that nothing resolved; give a path")
        return expand_path(path)

    def check_paths(self) -> None:
        """Checkpoint locations, before anything is written: resume_from_path (resume_mode=resume_path) is a
        global_step_N directory that exists; both locations are filesystem paths; resume_mode=disable starts at
        step 0, so default_local_dir must hold no checkpoints its saves would collide with (nothing is overwritten)."""
        if self.resume_mode == "resume_path" and self.resume_from_path is not None:
            path = expand_path(self.resume_from_path)
            if not path.is_dir():
                raise ValueError(f"trainer.resume_from_path={self.resume_from_path!r} does not exist")
            try:
                checkpoint_dirs.step_of(path)
            except ValueError as err:
                raise ValueError(f"trainer.resume_from_path={self.resume_from_path!r}: {err}") from None
        for key, value in (("default_local_dir", self.default_local_dir), ("resume_from_path", self.resume_from_path)):
            if value is not None and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(value)):
                raise ValueError(
                    f"trainer.{key}={value!r} is a URL, but checkpoints are written to a filesystem path (on several "
                    "nodes, one shared by all of them at the same path, e.g. an NFS mount); remote stores such as HDFS "
                    "or S3 are not supported: mount them, or give a local path"
                )
        steps = checkpoint_dirs.list_steps(self.local_dir())
        if self.resume_mode == "disable" and steps:
            raise ValueError(
                f"trainer.resume_mode=disable starts a new run, but trainer.default_local_dir={self.default_local_dir!r} "
                f"already holds checkpoints (steps {steps}); give the new run its own directory, or resume "
                "(trainer.resume_mode=auto)"
            )
        if self.resume_mode == "resume_path" and self.resume_from_path is not None and steps:
            self._check_resume_target(expand_path(self.resume_from_path).resolve(), steps)

    def _check_resume_target(self, source: Path, steps: list[int]) -> None:
        """resume_path into a directory that holds checkpoints: only from its own latest one. Another directory's
        checkpoint would mix this run's saves with that run's (and max_*_ckpt_to_keep would delete them); an older
        step of its own would collide with the later ones on the next save, after Ray and a training step."""
        resumed = checkpoint_dirs.step_of(source)
        where = f"trainer.default_local_dir={self.default_local_dir!r} already holds checkpoints (steps {steps})"
        if source.parent != self.local_dir().resolve():
            raise ValueError(
                f"trainer.resume_from_path={self.resume_from_path!r} is a checkpoint of another directory, but "
                f"{where}: this run's saves would mix with them; give the resumed run its own default_local_dir"
            )
        later = [step for step in steps if step > resumed]
        if later:
            raise ValueError(
                f"trainer.resume_from_path={self.resume_from_path!r} goes back to step {resumed}, but {where}, "
                f"{later} after it: its next saves would collide with them (nothing is overwritten). To go back, "
                f"copy global_step_{resumed} into a new directory and resume from that copy there"
            )

    def check_environment(self, ray_address: str | None) -> None:
        """Each tracking backend's package is installed; `device=cuda` has a GPU where the workers run: in the
        driver's process (local mode) or on the embedded cluster this machine starts. A cluster given by address is
        checked once joined (`use_accelerator`)."""
        for name in self.logger:
            package = LOGGER_PACKAGES.get(name)
            if package and importlib.util.find_spec(package) is None:
                raise ValueError(f"trainer.logger includes {name!r} but {package} is not installed; pip install {package}")
        if self.device == "cuda" and not self.joins_cluster(ray_address):
            # Imported here: counting devices imports torch, which a config error must not wait for.
            from hybridflow.utils.device import device_count

            if device_count() == 0:
                raise ValueError(
                    "trainer.device='cuda' but this machine has no CUDA device for its workers; use trainer.device=auto "
                    "or cpu, or join a GPU cluster (ray_kwargs.ray_init.address / RAY_ADDRESS)"
                )


@dataclass(frozen=True, kw_only=True)
class PPOTrainerConfig(RunConfig):
    """The RL run: RunConfig plus critic warm-up, validation-only runs and checkpoint retention."""

    critic_warmup: int = 0
    """Steps that update only the critic (must be below the number of steps)."""
    val_only: bool = False
    """Only validate the loaded policy (logged at step 0), no training."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Older checkpoints are deleted beyond this many; None keeps all."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """verl's separate critic limit; checkpoints hold actor and critic together, so it must equal the actor's."""
    log_val_generations: int = 0
    """Validation samples printed per validation."""
    rollout_data_dir: Optional[str] = None
    """Directory where each training step's generations are written, one JSON line per sample in <step>.jsonl
    (input, output, gts, score, step, uid, advantage); None writes nothing. A file is never overwritten."""
    validation_data_dir: Optional[str] = None
    """Directory where each validation's generations are written (<step>.jsonl: input, output, gts, score, step and
    the reward's per-sample details); None writes nothing."""
    balance_batch: bool = True
    """Reorder each step's samples so every data-parallel rank gets about the same number of tokens."""
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    """Checks after every step that make silent failures loud: alarms on the metrics, the memory budget."""
    default_hdfs_dir: Optional[str] = unsupported(None, "checkpoints stay in trainer.default_local_dir (a shared "
                                                  "filesystem on a cluster); they are not copied to HDFS")
    """verl: copy each checkpoint to HDFS."""
    del_local_ckpt_after_load: bool = unsupported(False, "a checkpoint is never deleted by loading it")
    """verl: delete the local checkpoint once it is loaded."""
    esi_redundant_time: int = unsupported(0, "Ascend NPU ESI (elastic saving) is not supported")
    """verl: seconds of redundancy for Ascend's elastic saving."""
    ray_wait_register_center_timeout: int = unsupported(
        300, "workers start through Ray's placement groups; trainer.rpc_timeout_s bounds every worker call"
    )
    """verl: seconds to wait for its workers' register center."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least("critic_warmup", self.critic_warmup, 0)
        check_positive("max_actor_ckpt_to_keep", self.max_actor_ckpt_to_keep, allow_none=True)
        if self.max_critic_ckpt_to_keep not in (None, self.max_actor_ckpt_to_keep):
            raise ConfigFieldError(
                "max_critic_ckpt_to_keep",
                f"max_critic_ckpt_to_keep={self.max_critic_ckpt_to_keep} differs from max_actor_ckpt_to_keep="
                f"{self.max_actor_ckpt_to_keep}; one checkpoint directory holds both, so set only max_actor_ckpt_to_keep",
            )
        check_at_least("log_val_generations", self.log_val_generations, 0)


@dataclass(frozen=True, kw_only=True)
class SFTTrainerConfig(RunConfig):
    """The SFT run: RunConfig plus checkpoint retention."""

    project_name: str = "hybridflow-sft"
    """Tracking project."""
    experiment_name: str = "sft"
    """Tracking run name."""
    test_freq: Union[int, Literal["after_each_epoch"]] = -1
    """Validate every N steps and at the last step, or after_each_epoch (verl's engine SFT); -1: at the last step
    only (verl's SFT trainer validates there)."""
    save_freq: Union[int, Literal["after_each_epoch"]] = -1
    """Checkpoint every N steps, or after_each_epoch, and at the last step (-1: at the last step only, as verl's SFT
    trainer saves there)."""
    default_hdfs_dir: Optional[str] = unsupported(None, "checkpoints stay in trainer.default_local_dir")
    """verl: copy checkpoints to HDFS."""
    profile_interval: list[int] = unsupported([-1, -1], "profile with global_profiler in hybridflow train")
    """verl's engine SFT: the steps to profile."""
    max_ckpt_to_keep: Optional[int] = None
    """Older checkpoints are deleted beyond this many; None keeps all."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What a checkpoint holds and what a resumed run reads (verl's trainer.checkpoint.*; hf_model adds a full
    HF directory, `huggingface_full/`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("max_ckpt_to_keep", self.max_ckpt_to_keep, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class RayInitConfig:
    """How the driver starts or joins Ray (`ray_kwargs.ray_init.*`)."""

    address: Optional[str] = None
    """Existing cluster address; None starts the embedded local cluster (RAY_ADDRESS also works)."""
    num_cpus: Optional[int] = None
    """CPUs of the embedded cluster; None uses the machine's cores (at least the workers' needs)."""

    def __post_init__(self) -> None:
        check_positive("num_cpus", self.num_cpus, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class RayKwargsConfig:
    """Ray settings (verl's `ray_kwargs`)."""

    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """Arguments of ray.init."""
    timeline_json_file: Optional[str] = None
    """Write Ray's timeline of the run's tasks (Chrome trace JSON, ray.timeline) to this file when the run ends
    (verl's key); never over an existing file."""

    def check_output_files(self) -> None:
        """The timeline file the run writes at its end does not exist yet (nothing is written over)."""
        timeline = self.timeline_json_file
        if timeline is not None and expand_path(timeline).exists():
            raise ValueError(
                f"ray_kwargs.timeline_json_file={timeline!r} exists; the run writes Ray's timeline there at its end "
                "and never over a file: name a new one"
            )


@dataclass(frozen=True, kw_only=True)
class RewardManagerModuleConfig:
    """verl's `reward_manager.module.*`: a reward manager class loaded from a file."""

    path: Optional[str] = unsupported(
        None, "reward managers are registered in code (hybridflow.rewards.REWARD_MANAGERS.register) and named by reward_model.reward_manager"
    )
    """verl: the file defining it."""
    name: str = "custom_reward_manager"
    """verl: its class (read only with path, which is not built)."""


@dataclass(frozen=True, kw_only=True)
class RewardManagerSectionConfig:
    """verl's top-level `reward_manager.*` (its newer home of the reward manager's choice)."""

    name: Optional[str] = None
    """verl's copy of reward_model.reward_manager (derived from it); set that key instead."""
    source: Literal["register"] = "register"
    """Where the manager class comes from: register, hybridflow's registry (importlib, a file, is not offered)."""
    module: RewardManagerModuleConfig = field(default_factory=RewardManagerModuleConfig)
    """verl: a manager class from a file."""


@dataclass(frozen=True, kw_only=True)
class TransferQueueConfig:
    """verl's `transfer_queue.*` (its experimental data plane between stages)."""

    enable: bool = unsupported(False, "batches travel between stages as DataProto through Ray's object store")
    """verl: move batches through TransferQueue."""


@dataclass(frozen=True, kw_only=True)
class RewardSectionConfig(RewardModelConfig, RewardModelWorkerConfig):
    """verl's `reward_model.*` section: rule-based scoring (`rewards`) and the learned reward model (`workers`)."""

    def __post_init__(self) -> None:
        RewardModelWorkerConfig.__post_init__(self)
        RewardModelConfig.__post_init__(self)
        if self.rule_reward_coef != 0 and not self.enable:
            raise ConfigFieldError(
                "rule_reward_coef",
                f"rule_reward_coef={self.rule_reward_coef} weighs rule scores against a reward model's, but "
                "reward_model.enable=False: enable the reward model or leave rule_reward_coef at 0",
            )


# ----------------------------------------------------------------------------- roots
@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The whole PPO/GRPO config (the root that command-line overrides address)."""

    data: RLHFDataConfig = field(default_factory=RLHFDataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardSectionConfig = field(default_factory=RewardSectionConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    reward_manager: RewardManagerSectionConfig = field(default_factory=RewardManagerSectionConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)

    @property
    def estimator(self) -> EstimatorSpec:
        """What `algorithm.adv_estimator` needs from the run (a critic, groups, a greedy baseline, an implicit PRM)."""
        return estimator_spec(self.algorithm.adv_estimator)

    @property
    def critic_enabled(self) -> bool:
        """Whether a critic is trained: explicit `critic.enable`, else exactly when the estimator needs values."""
        if self.critic.enable is None:
            return self.estimator.needs_critic
        return self.critic.enable

    @property
    def uses_reference(self) -> bool:
        """Whether reference log-probs are needed (KL loss or KL-in-reward)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def uses_prime(self) -> bool:
        """Whether the run is PRIME: its reward model is an implicit process reward model trained online."""
        return self.estimator.implicit_prm

    @property
    def generative_reward_model(self) -> bool:
        """Whether the reward model is a generative judge (verl's reward loop with a custom reward function): it is
        served over HTTP and the function's score is the reward."""
        return (self.reward_model.serves_in_reward_loop and self.custom_reward_function.path is not None
                and not self.uses_prime)

    @property
    def reward_model_only(self) -> bool:
        """Whether training rewards come from a reward model alone (no rule scorer runs on training batches)."""
        return (self.reward_model.enable and self.reward_model.rule_reward_coef == 0 and not self.uses_prime
                and not self.generative_reward_model)

    @property
    def old_log_prob_source(self) -> OldLogProbSource:
        """Where a step's old log-probs come from.

        - `rollout`: `algorithm.rollout_correction.bypass_mode`, the rollout engine's own log-probs;
        - `recompute`: a separate forward of the actor before the update (verl's default dataflow); always with
          rollout correction (`rollout_is` / `rollout_rs`), whose weights and rejections need the trainer's old
          log-probs on the driver before the update, and with `actor.calculate_sum_pi_squared` (that pass returns
          sum(pi^2), which the optimal token baseline reads before the update);
        - `update`: otherwise, when the update is exactly on-policy (one epoch, one mini-batch per step, no
          KL-in-reward, which needs them before the update), the old log-probs equal the update's first forward,
          detached: no separate pass.
        """
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode:
            return "rollout"
        actor = self.actor_rollout_ref.actor
        if correction.enabled or actor.calculate_sum_pi_squared:
            return "recompute"
        one_step = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == self.data.train_batch_size
        return "update" if one_step and not self.algorithm.use_kl_in_reward else "recompute"


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"

PPO_DERIVED: dict[str, str] = {
    # agent loops (async) for multi-turn generation, which only they run; else batch generation (loader's resolver)
    f"{_ROLLOUT}.mode": (f"${{rollout_mode_for:${{{_ROLLOUT}.multi_turn.enable}},${{{_ROLLOUT}.multi_turn.tool_config_path}},"
                         f"${{{_ROLLOUT}.multi_turn.interaction_config_path}}}}"),
    f"{_ROLLOUT}.prompt_length": "${data.max_prompt_length}",
    f"{_ROLLOUT}.response_length": "${data.max_response_length}",
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu": f"${{{_ACTOR}.ppo_micro_batch_size_per_gpu}}",
    f"{_ROLLOUT}.log_prob_use_dynamic_bsz": f"${{{_ACTOR}.use_dynamic_bsz}}",
    f"{_ROLLOUT}.log_prob_max_token_len_per_gpu": f"${{{_ACTOR}.ppo_max_token_len_per_gpu}}",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": f"${{{_ROLLOUT}.log_prob_micro_batch_size_per_gpu}}",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": f"${{{_ACTOR}.use_dynamic_bsz}}",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": f"${{{_ACTOR}.ppo_max_token_len_per_gpu}}",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": f"${{{_ACTOR}.ulysses_sequence_parallel_size}}",
    "actor_rollout_ref.ref.fsdp_config.tensor_parallel_size": f"${{{_ACTOR}.fsdp_config.tensor_parallel_size}}",
    "actor_rollout_ref.ref.fsdp_config.expert_parallel_size": f"${{{_ACTOR}.fsdp_config.expert_parallel_size}}",
    "actor_rollout_ref.ref.model.path": "${actor_rollout_ref.model.path}",
    "actor_rollout_ref.ref.model.tokenizer_path": "${actor_rollout_ref.model.tokenizer_path}",
    "actor_rollout_ref.ref.model.trust_remote_code": "${actor_rollout_ref.model.trust_remote_code}",
    "actor_rollout_ref.ref.model.use_remove_padding": "${actor_rollout_ref.model.use_remove_padding}",
    "actor_rollout_ref.ref.model.use_fused_kernels": "${actor_rollout_ref.model.use_fused_kernels}",
    "actor_rollout_ref.ref.model.fused_kernel_options.chunk_size": (
        "${actor_rollout_ref.model.fused_kernel_options.chunk_size}"
    ),
    f"{_ACTOR}.optim.clip_grad": f"${{{_ACTOR}.grad_clip}}",
    **{f"{role}.rollout_n": f"${{{_ROLLOUT}.n}}" for role in (_ACTOR, "actor_rollout_ref.ref", "critic")},
    f"{_ACTOR}.use_remove_padding": "${actor_rollout_ref.model.use_remove_padding}",
    f"{_ACTOR}.use_fused_kernels": "${actor_rollout_ref.model.use_fused_kernels}",
    "reward_manager.name": "${reward_model.reward_manager}",
    "critic.model.path": "${actor_rollout_ref.model.path}",
    "critic.model.tokenizer_path": "${actor_rollout_ref.model.tokenizer_path}",
    "critic.model.trust_remote_code": "${actor_rollout_ref.model.trust_remote_code}",
    "critic.ppo_mini_batch_size": f"${{{_ACTOR}.ppo_mini_batch_size}}",
    "critic.ppo_micro_batch_size_per_gpu": f"${{{_ACTOR}.ppo_micro_batch_size_per_gpu}}",
    "critic.forward_micro_batch_size_per_gpu": "${critic.ppo_micro_batch_size_per_gpu}",
    "critic.use_dynamic_bsz": f"${{{_ACTOR}.use_dynamic_bsz}}",
    "critic.forward_max_token_len_per_gpu": "${critic.ppo_max_token_len_per_gpu}",
    "critic.ppo_epochs": f"${{{_ACTOR}.ppo_epochs}}",
    "critic.shuffle": f"${{{_ACTOR}.shuffle}}",
    "critic.loss_agg_mode": f"${{{_ACTOR}.loss_agg_mode}}",
    "critic.use_prefix_grouper": f"${{{_ACTOR}.use_prefix_grouper}}",
    "critic.optim.clip_grad": "${critic.grad_clip}",
    "reward_model.model.input_tokenizer": "${actor_rollout_ref.model.path}",
    "reward_model.model.use_remove_padding": "${actor_rollout_ref.model.use_remove_padding}",
    "reward_model.use_dynamic_bsz": "${critic.use_dynamic_bsz}",
    "reward_model.forward_max_token_len_per_gpu": "${critic.forward_max_token_len_per_gpu}",
    **{f"{role}.profiler.{key}": f"${{global_profiler.{key}}}" for role in PROFILED_SECTIONS.values() for key in ("tool", "save_path")},
    **{f"{role}.profiler.tool_config.{key}": f"${{global_profiler.global_tool_config.{key}}}"
       for role in PROFILED_SECTIONS.values()
       for key in ("nsys.discrete", "torch_memory.trace_alloc_max_entries", "torch_memory.stack_depth")},
    **{f"{_ROLLOUT}.profiler.{key}": f"${{{_ACTOR}.profiler.{key}}}" for key in ("enable", "all_ranks", "ranks")},
}
"""verl's interpolations: each key's default is the value of the key it names (set it to break the link)."""


def _sft_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5, betas=(0.9, 0.95), lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine")


@dataclass(frozen=True, kw_only=True)
class SFTModelConfig(FSDPModelConfig):
    """SFT's `model.*` (verl's fsdp_sft_trainer keys): the model and its sharding."""

    strategy: Strategy = "fsdp2"
    """Training engine: fsdp2 (verl's SFT default; fsdp is accepted as a synonym, both shard with FSDP2)."""


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The whole SFT config (verl's SFT keys; `model.partial_pretrain` is verl's name for `model.path`, and the
    top-level `use_remove_padding` for `model.use_remove_padding`)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: OptimConfig = field(default_factory=_sft_optim)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    ulysses_sequence_parallel_size: int = 1
    """Ranks that split each packed sequence (Ulysses); needs model.use_remove_padding=True."""

    def engine_config(self, total_training_steps: int = -1) -> FSDPEngineConfig:
        """The SFT worker's training engine (validation calls it before Ray, so the engine's rules run there)."""
        return FSDPEngineConfig(
            model=self.model,
            fsdp=self.model.fsdp_config,
            optim=self.optim,
            micro_batch_size_per_gpu=self.data.micro_batch_size_per_gpu,
            total_training_steps=total_training_steps,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
        )


SFT_DERIVED: dict[str, str] = {}
"""SFT has no interpolated defaults."""
