"""Config of the reward-model worker (`reward_model.*`'s worker part): the reward model's weights, the legacy
worker's micro-batching and pool, and verl's reward loop (`reward_model.rollout.*`), which serves the model in
tensor-parallel replicas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from hybridflow.engines.training.config import FSDPConfig, FSDPEngineConfig, FSDPModelConfig, OptimConfig
from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, unsupported
from hybridflow.utils.profiler_config import RoleProfilerConfig
from hybridflow.workers.config import Strategy

__all__ = ["REWARD_SERVING_ENGINES", "RewardModelModelConfig", "RewardModelWorkerConfig", "RewardServingConfig"]


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


REWARD_SERVING_ENGINES = ("hf", "native")
"""Engines that serve a generative reward model (rollout engines)."""
DISCRIMINATIVE_SERVING_ENGINES = ("hf",)
"""Engines that score with a discriminative reward model (transformers' forward)."""
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
    """Serving engine: hf (None is hf): transformers' forward for a discriminative reward model, transformers'
    generate for a generative one; native: hybridflow's decode loop, for a generative one. vllm and sglang servers
    are not built for reward models; they are refused."""
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
                "its own engine (FSDP2, tensor parallelism) and a generative one with its rollout engines, not a "
                "vLLM/SGLang server; set reward_model.rollout.name=hf (or native for a generative reward model)",
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
    def engine(self) -> str:
        """The serving engine's name (None is hf)."""
        return self.name or DISCRIMINATIVE_SERVING_ENGINES[0]

    @property
    def scores_discriminative(self) -> bool:
        """Whether the engine can score with a discriminative reward model."""
        return self.engine in DISCRIMINATIVE_SERVING_ENGINES

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
    reward_loop_source: Literal["register"] = "register"
    """verl: where its reward-loop class comes from; register, the built-in loop, is what runs here."""
    reward_loop_module_path: Optional[str] = unsupported(None, "the reward loop is hybridflow's own (a user class from "
                                                         "a file is not loaded)")
    """verl: a file defining a reward-loop class of your own."""
    reward_loop_class_name: Optional[str] = unsupported(None, "the reward loop is hybridflow's own (a user class from "
                                                        "a file is not loaded)")
    """verl: that class's name."""
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
                    f"model as reward_model.rollout says; set reward_model.{loop_key} instead, or "
                    "use_reward_loop=False",
                )

    @property
    def serves_in_reward_loop(self) -> bool:
        """Whether the reward model is served as verl's reward loop serves it (`rollout`)."""
        return self.enable and self.use_reward_loop

    @property
    def offloads_between_scorings(self) -> bool:
        """Whether the weights wait on the host between scorings (the reward loop's free_cache_engine)."""
        return self.serves_in_reward_loop and self.rollout.free_cache_engine

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
