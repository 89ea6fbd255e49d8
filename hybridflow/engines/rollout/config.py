"""The rollout's config (`actor_rollout_ref.rollout.*`): sampling, the engine, the generation server and the
turn limits of agent loops.

`SamplingConfig` is defined once: `RolloutConfig` extends it (training sampling) and `val_kwargs` is one
(validation sampling). `SamplingParams.from_config` turns either into one call's parameters, with the greedy
rule of `SamplingConfig.is_greedy` in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hybridflow.engines.rollout.registry import ROLLOUTS, RolloutSpec, backends_with, rollout_spec
from hybridflow.utils.config import (
    ConfigFieldError,
    check_at_least,
    check_literal_fields,
    check_micro_batch,
    check_positive,
    check_range,
    unsupported,
)
from hybridflow.utils.profiler_config import RoleProfilerConfig

VLLM_RESERVED_KWARGS = (
    "model", "tokenizer", "generation_config", "logprobs_mode", "seed", "distributed_executor_backend",
    "tensor_parallel_size", "worker_extension_cls", "hf_overrides", "kv_cache_memory_bytes", "enable_expert_parallel",
)
"""`vllm.LLM` arguments that hybridflow's vllm engine sets from its own state (`vllm_convert.compute_vllm_engine_kwargs`):
not settable through rollout.engine_kwargs.vllm."""

__all__ = ["AgentLoopConfig", "MultiTurnConfig", "RolloutConfig", "SamplingConfig"]

OTHER_LIBRARIES_ENGINES = {
    "sglang": " (SGLang is verl's other rollout engine, not one of hybridflow's: use vllm where it is installed, or "
              "native)",
    "trtllm": " (TensorRT-LLM is not one of hybridflow's rollout engines: use vllm where it is installed, or native)",
}
"""Rollout names verl's command lines use that hybridflow has no engine for: what to use instead."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How responses are sampled."""

    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 means greedy. Log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 disables."""
    n: int = 1
    """Responses per prompt (the GRPO group size; mean@n, best@n, maj@n in validation)."""
    do_sample: bool = True
    """False is greedy decoding."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("temperature", self.temperature, 0.0, "0 is greedy")
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigFieldError("top_k", f"top_k={self.top_k} must be -1 (disabled) or >= 1")
        check_positive("n", self.n)

    @property
    def is_greedy(self) -> bool:
        """The one greedy rule: no sampling, or temperature 0 (verl's way of asking for greedy)."""
        return not self.do_sample or self.temperature == 0

    @property
    def log_prob_temperature(self) -> float:
        """What logits are divided by for log-probs: the temperature, or 1.0 for greedy decoding."""
        return 1.0 if self.is_greedy else self.temperature


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """Multi-turn generation with tools and interactions (`rollout.mode=async`, agent `tool_agent`)."""

    enable: bool = False
    """Use the tool agent loop for rows without an `agent_name`."""
    max_assistant_turns: Optional[int] = 5
    """Model turns per trajectory; None: no limit, the response length ends it (verl's default)."""
    max_user_turns: Optional[int] = 3
    """Interaction (simulated user) turns per trajectory; None: no limit (verl's default)."""
    max_tokens_per_turn: Optional[int] = None
    """New tokens per model turn (None: whatever is left of data.max_response_length)."""
    max_parallel_calls: int = 4
    """Tool calls executed from one model turn; extra calls get an error message."""
    max_tool_response_length: int = 256
    """Characters of a tool's output kept in the conversation."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a long tool output is cut."""
    tool_config_path: Optional[str] = None
    """YAML file listing the tools (verl's format: `tools: [{class_name|name, config, tool_schema}]`)."""
    interaction_config_path: Optional[str] = None
    """YAML file listing interactions (`interaction: [{name, class_name, config}]`)."""
    format: Literal["hermes"] = "hermes"
    """Tool-call format parsed from model text."""
    num_repeat_rollouts: Optional[int] = unsupported(
        None, "each row's rollout.n samples are its repeats; the tool agent loop does not repeat a rollout itself"
    )
    """verl (SGLang multi-turn): repeats of one rollout."""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = unsupported(
        "strict", "every turn's tokens are checked against the chat template's rendering (strict) by the agent loop"
    )
    """verl: how the multi-turn token ids are checked against the template's rendering of the messages."""
    use_inference_chat_template: bool = unsupported(
        False, "the conversation is tokenized with the training chat template, turn by turn (token continuity)"
    )
    """verl: render turns with the model's inference-time chat template (e.g. Qwen3's thinking removal)."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_positive("max_assistant_turns", self.max_assistant_turns, allow_none=True)
        check_positive("max_parallel_calls", self.max_parallel_calls)
        check_positive("max_tokens_per_turn", self.max_tokens_per_turn, allow_none=True)
        check_positive("max_tool_response_length", self.max_tool_response_length)
        if self.max_user_turns is not None:
            check_at_least("max_user_turns", self.max_user_turns, 0)


@dataclass(frozen=True, kw_only=True)
class CustomAsyncServerConfig:
    """verl's `rollout.agent.custom_async_server.*`: a user class replacing its async server."""

    name: Optional[str] = unsupported(
        None, "the generation servers are hybridflow's own (engines/rollout/server.py) over the rollout engines"
    )
    """verl: the class's name."""
    path: Optional[str] = unsupported(
        None, "the generation servers are hybridflow's own (engines/rollout/server.py) over the rollout engines"
    )
    """verl: the file defining it."""


_PROMETHEUS_ONLY = "read only with prometheus.enable=True, which is not built"
_TRACE_ONLY = "read only with a trace.backend, which is not built"


@dataclass(frozen=True, kw_only=True)
class PrometheusConfig:
    """verl's `rollout.prometheus.*`: the rollout servers' metrics exported to Prometheus."""

    enable: bool = unsupported(False, "rollout metrics go to the trainer's loggers (trainer.logger), not Prometheus")
    """verl: export them."""
    port: int = unsupported(9090, _PROMETHEUS_ONLY)
    """verl: the Prometheus server's port."""
    file: str = unsupported("/tmp/ray/session_latest/metrics/prometheus/prometheus.yml", _PROMETHEUS_ONLY)
    """verl: its config file."""
    served_model_name: Optional[str] = unsupported(None, _PROMETHEUS_ONLY)
    """verl: the model name in the metrics."""


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """verl's `rollout.trace.*`: agent loops traced to weave or mlflow."""

    backend: Optional[str] = unsupported(
        None, "agent-loop traces are not exported; trainer.rollout_data_dir dumps every step's generations"
    )
    """verl: weave or mlflow."""
    token2text: bool = unsupported(False, _TRACE_ONLY)
    """verl: decode token ids in the traces."""
    max_samples_per_step_per_worker: Optional[int] = unsupported(None, _TRACE_ONLY)
    """verl: samples traced per step and worker."""


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
    num_workers: int = unsupported(
        8, "agent loops run as asyncio tasks in the driver (max_concurrent_loops at once), not in worker processes"
    )
    """verl: processes its agent loops are spread over."""
    agent_loop_config_path: Optional[str] = unsupported(
        None, "agent loops are registered in code (hybridflow.agents register_agent_loop) and named per row"
    )
    """verl: a YAML file registering agent loop classes."""
    custom_async_server: CustomAsyncServerConfig = field(default_factory=lambda: CustomAsyncServerConfig())
    """verl: a user class replacing its async server."""

    def __post_init__(self) -> None:
        check_positive("max_concurrent_loops", self.max_concurrent_loops)
        check_positive("max_concurrent_requests_per_replica", self.max_concurrent_requests_per_replica)
        check_at_least("server_batch_wait_s", self.server_batch_wait_s, 0.0)


def _val_sampling() -> SamplingConfig:
    return SamplingConfig(temperature=0.0, do_sample=False)


_VLLM_ONLY_KEYS = (
    "enforce_eager", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
    "enable_prefix_caching", "load_format", "disable_log_stats",
)
"""Rollout keys only the vllm engine reads."""


DEFAULT_BUCKET_MEGABYTES = 2048
"""verl's `rollout.checkpoint_engine.update_weights_bucket_megabytes` default."""


@dataclass(frozen=True, kw_only=True)
class CheckpointEngineConfig:
    """verl's weight-transfer settings (`rollout.checkpoint_engine.*`). The hand-over to a colocated rollout copies one
    full tensor at a time in memory; a split pool's broadcast packs the tensors into buckets."""

    backend: str = unsupported("naive", "weights are handed over in memory (colocated) or broadcast (split pools)")
    """verl: the transfer backend."""
    update_weights_bucket_megabytes: int = DEFAULT_BUCKET_MEGABYTES
    """Split placement (hybrid_engine=False): the actor's weights reach the rollout pool in broadcasts of buckets of
    about this many MiB, one collective per bucket (a larger tensor goes alone). A colocated hand-over copies in
    memory, tensor by tensor, and refuses another value."""
    engine_kwargs: dict[str, Any] = unsupported({}, "there is no separate transfer engine to configure")
    """verl: the backend's own settings."""

    def __post_init__(self) -> None:
        check_positive("update_weights_bucket_megabytes", self.update_weights_bucket_megabytes)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(SamplingConfig):
    """Generation of responses: the engine, its sampling, and how log-probs are recomputed."""

    name: str = "hf"
    """Rollout engine: hf | native | vllm."""
    mode: Literal["sync", "async"] = "sync"
    """sync (batch generate) | async (generation server for agent loops). The PPO trainer's default: async when
    multi_turn.enable or a multi_turn tool or interaction config is set (tools and interactions run in agent
    loops; verl's default mode is async), else sync."""
    prompt_length: int = 512
    """Prompt tokens (the trainer sets it from data.max_prompt_length)."""
    response_length: int = 512
    """Most tokens generated per response (the trainer sets it from data.max_response_length)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = 8
    """Samples per forward when recomputing old log-probs (the PPO trainer sets it from
    actor.ppo_micro_batch_size_per_gpu unless given; 8 applies to a rollout built on its own); null only with
    log_prob_use_dynamic_bsz."""
    log_prob_micro_batch_size: Optional[int] = None
    """verl's old global form of log_prob_micro_batch_size_per_gpu: that key becomes this // the role's
    data-parallel ranks when the config loads (verl's workers divide it so)."""
    log_prob_use_dynamic_bsz: bool = False
    """Cut old-log-prob micro-batches by token count (log_prob_max_token_len_per_gpu) instead of rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Tokens per old-log-prob micro-batch on one rank with log_prob_use_dynamic_bsz."""
    calculate_log_probs: bool = False
    """Return the sampled tokens' log-probs (`rollout_log_probs`, which rollout correction and bypass mode read);
    the hf, native and vllm engines always return them, at no extra forward, so both values work."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of one rollout replica (native and hf engines): consecutive groups of this many ranks
    each decode one replica, every rank holding its share of the heads, the MLP and the vocabulary. With
    mode=async the group's first rank takes the replica's requests and drives the others."""
    gpu_memory_utilization: float = 0.5
    """Fraction of this device's memory (a GPU's; on CPU the host's RAM divided by the worker group's ranks on that
    node) the rollout's weights and KV cache may take. vllm sizes its KV cache from it; hf and native decode at most
    as many sequences at once as fit (hf in generate calls of that many rows, native in that many cache slots), and
    refuse to start when the weights alone exceed it."""
    free_cache_engine: bool = True
    """Free the rollout engine's KV cache after generation (hybrid engine); vllm: its sleep mode is enabled
    only when True (weights to host memory and KV cache freed while the trainer runs)."""
    layered_summon: bool = False
    """verl: gather a sharded LoRA model for the rollout layer by layer rather than whole. The hand-over gathers
    (and merges) one tensor at a time whatever the value, so both values hold."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight and compute dtype of the rollout's weights (the vllm engine; hf/native: the actor's own module where
    it already has this dtype, else a copy in it that the hand-over refreshes). auto is bfloat16 on GPU, float32
    on CPU (bf16 matmuls are slow on CPUs without bf16 units), and on one CPU rank the actor's module as it is;
    unlike vLLM's own auto it does not follow the checkpoint's dtype. verl's default: bfloat16."""
    enforce_eager: Optional[bool] = None
    """vllm engine: True runs eagerly, False captures CUDA graphs / compiles. None: False on GPU (verl's
    default), True on CPU (vLLM's CPU backend would compile with inductor at start-up, minutes). native engine:
    True decodes eagerly on CUDA, None or False replays its decode step from CUDA graphs (on CUDA, one rank per
    replica, dense models; other devices always run eagerly)."""
    max_model_len: Optional[int] = None
    """vllm engine: longest prompt + response a sequence may reach; None is prompt_length + response_length."""
    max_num_seqs: int = 256
    """vllm engine: sequences decoded together. native engine, where set: its KV-cache slots (default 64)."""
    max_num_batched_tokens: int = 8192
    """vllm engine: tokens per engine step (prefill chunks and decodes together). native engine, where set: the
    tokens one prefill chunk takes (default 4096)."""
    enable_chunked_prefill: bool = True
    """vllm engine: split long prefills over steps; False needs max_num_batched_tokens >= max_model_len."""
    enable_prefix_caching: bool = True
    """vllm engine: reuse the KV cache of shared prompt prefixes (reset after every weight update)."""
    load_format: Literal["auto", "dummy", "safetensors"] = "auto"
    """vllm engine: how vLLM loads weights at start-up. dummy: random weights, the actor's arrive with the first
    update_weights (GPU only: on CPU new weights are reloaded with vLLM's own file loader, which dummy lacks).
    verl's default is dummy; auto here, because dummy cannot run on CPU and saves only one checkpoint read."""
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra keyword arguments per engine (verl's key): engine_kwargs.vllm.* go to `vllm.LLM` as given (with
    name=vllm; the arguments hybridflow sets for its own wiring are refused). Other engines take none: a non-empty
    entry for an engine this run does not use is refused."""
    val_kwargs: SamplingConfig = field(default_factory=_val_sampling)
    """Sampling of validation rollouts (greedy by default)."""
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """Agent loops (mode=async)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tools, interactions and turn limits of the tool agent loop."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Profiling of the processes hosting the rollout (see global_profiler; enable, all_ranks and ranks default to
    the actor's)."""
    enable_rollout_routing_replay: bool = False
    """MoE models: record each position's experts per layer (`routed_experts`) for router replay (R3, with
    actor.router_replay.mode=R3); the hf engine in sync mode records them."""
    expert_parallel_size: int = 1
    """Ranks that split one rollout replica's experts (verl's key): 1, or tensor_model_parallel_size (native and hf
    engines; vllm: its `enable_expert_parallel`). Under rollout tensor parallelism a mixture-of-experts layer's
    experts are split whole over the group, E / tp per rank, with either value: 1 is verl's default, where vLLM
    splits each expert's width over the group instead, the same share of the expert weights per rank and the same
    all-reduce of the partial outputs."""
    data_parallel_size: int = unsupported(
        1, "replicas are data-parallel already (the pool's ranks / tensor_model_parallel_size); data-parallel "
        "attention inside one replica is not wired"
    )
    """verl: data-parallel ranks inside one rollout replica (vLLM's data-parallel attention)."""
    over_sample_rate: float = 0.0
    """Training batches: once int(N * (1 - over_sample_rate)) of N trajectories have ended, the rest are aborted;
    each keeps its prompt with an empty response (no loss; the reward of an empty response), as verl pads them,
    flagged in `__aborted__` and counted in verl's `response/aborted_ratio`. With mode=async over the batch's agent
    loops on all replicas; with mode=sync (native and hf engines) over each generate call of each rank.
    0: every trajectory runs to its end."""
    multi_stage_wake_up: bool = False
    """Wake the rollout in two stages around each weight hand-over (verl's key, SGLang's in verl): its weights first,
    then, once the trainer's tensors are copied in and freed, its KV cache; so the hand-over's transient full tensors
    and the cache never take memory together. The native engine frees and reallocates its cache (with
    free_cache_engine); the hf engine allocates its cache inside generate, so it is staged either way; vllm wakes its
    weights, then its cache."""
    skip_tokenizer_init: bool = unsupported(
        True, "hybridflow's engines take token ids and return token ids; decoding is the trainer's and the reward's"
    )
    """verl: the engine starts without a tokenizer (token ids in, token ids out), as hybridflow's always work."""
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=lambda: CheckpointEngineConfig())
    """verl: how weights travel to the rollout (hybridflow hands them over one tensor at a time)."""
    logprobs_mode: Literal["processed_logprobs"] = "processed_logprobs"
    """Which log-probs the rollout reports (verl's key): processed_logprobs, of the temperature-scaled distribution
    before top-k/top-p filtering, is what the hf and native engines return and the trainer recomputes. vLLM's
    raw_logprobs / processed_logits are not offered."""
    ignore_eos: bool = unsupported(False, "a response ends at the tokenizer's eos (or response_length)")
    """verl: keep generating past eos."""
    cudagraph_capture_sizes: Optional[list[int]] = unsupported(
        None, "give vLLM its compilation settings through rollout.engine_kwargs.vllm (name=vllm)"
    )
    """verl: vLLM's CUDA-graph batch sizes."""
    disable_log_stats: bool = True
    """vLLM's engine statistics logging off (verl's key, passed to vllm.LLM; name=vllm only)."""
    pipeline_model_parallel_size: int = unsupported(1, "a rollout replica splits by tensor parallelism only")
    """verl: pipeline stages of one rollout replica."""
    quantization: Optional[str] = unsupported(None, "rollouts generate in rollout.dtype; quantized serving is not built")
    """verl: quantize the rollout's weights (e.g. fp8)."""
    quantization_config_file: Optional[str] = unsupported(None, "rollouts generate in rollout.dtype")
    """verl: the quantization's settings."""
    scheduling_policy: Literal["fcfs"] = "fcfs"
    """Order in which a generation server takes requests (verl's key): fcfs, first come first served, is what
    hybridflow's servers do (vLLM's priority scheduling is not offered)."""
    skip_rollout: bool = False
    """Debugging (verl's key): the run's first training generation is dumped to skip_dump_dir and replayed by every
    later step, and by later runs of the same name and batch shape, instead of generating; validation generates
    (`trainer/rollout_replay.py`). `hybridflow train` only; not with dynamic sampling or ReMax."""
    skip_dump_dir: str = "/tmp/rollout_dump"
    """Where skip_rollout's dump is (`{experiment}_{project}_GBS{train_batch_size}__N{n}.pt`)."""
    mtp: Optional[dict[str, Any]] = unsupported(None, "multi-token prediction (speculative decoding) is not built")
    """verl: the rollout's copy of model.mtp."""
    prometheus: PrometheusConfig = field(default_factory=lambda: PrometheusConfig())
    """verl: export the rollout servers' metrics to Prometheus."""
    trace: TraceConfig = field(default_factory=lambda: TraceConfig())
    """verl: trace agent loops."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in ROLLOUTS:  # first: the checks below would read as if the engine existed
            raise ConfigFieldError(
                "name", f"name={self.name!r} is unknown; known: {sorted(ROLLOUTS.names())}"
                f"{OTHER_LIBRARIES_ENGINES.get(self.name, '')}",
            )
        check_positive("prompt_length", self.prompt_length)
        check_positive("response_length", self.response_length)
        check_micro_batch("log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu,
                          "log_prob_use_dynamic_bsz", self.log_prob_use_dynamic_bsz)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_positive("log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu)
        check_positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
        tp = self.tensor_model_parallel_size
        spec = self.backend_spec
        if tp > 1 and not spec.tensor_parallel:
            splitting = backends_with("tensor_parallel")
            raise ConfigFieldError(
                "tensor_model_parallel_size",
                f"tensor_model_parallel_size={tp} with name={self.name!r}: only {splitting} split a replica over "
                f"ranks{spec.tensor_parallel_note}; use name={splitting[0]} or tensor_model_parallel_size=1",
            )
        self._check_moe()
        self._check_over_sampling()
        self._check_engine_kwargs()
        if spec.reads_engine_keys:
            self._check_vllm_engine()
        else:
            self._refuse_vllm_only_keys()

    @property
    def backend_spec(self) -> RolloutSpec:
        """What the backend `name` can do (`engines/rollout/registry.py`); an unknown name (refused with the known
        ones by the checks before Ray) declares nothing."""
        return rollout_spec(self.name) if self.name in ROLLOUTS else RolloutSpec()

    def _check_moe(self) -> None:
        """Routing is recorded by the hf engine's batch generation only; experts split over the tensor-parallel
        group of the engines that split a replica (the model's side is checked before Ray starts, `check_rollout_parallelism`)."""
        ep, tp = self.expert_parallel_size, self.tensor_model_parallel_size
        check_positive("expert_parallel_size", ep)
        if ep != 1 and ep != tp:
            fix = (f"set tensor_model_parallel_size={ep} or expert_parallel_size=1" if tp == 1
                   else f"set expert_parallel_size={tp}")
            raise ConfigFieldError(
                "expert_parallel_size",
                f"expert_parallel_size={ep} with tensor_model_parallel_size={tp}: the rollout splits the experts "
                f"over a replica's tensor-parallel group, so the two are equal; {fix}",
            )
        if self.enable_rollout_routing_replay and (not self.backend_spec.records_routing or self.mode != "sync"):
            recording = backends_with("records_routing")
            raise ConfigFieldError(
                "enable_rollout_routing_replay",
                f"enable_rollout_routing_replay=True with name={self.name!r}, mode={self.mode!r}: only the sync "
                f"generation of {recording} records the routed experts; use name={recording[0]} mode=sync or leave "
                "it False",
            )

    def _check_over_sampling(self) -> None:
        """Aborts reach the agent loops' generation servers (async), or end a batch generation early in an engine whose
        spec says it can (sync: `ends_batches_early`); a streaming server split over ranks decodes what its leader
        admitted in lock-step, so it could end only the queued requests, not the slow ones."""
        rate = self.over_sample_rate
        check_range("over_sample_rate", rate, 0.0, 1.0, high_open=True)
        if rate > 0.0 and self.mode == "sync" and not self.backend_spec.ends_batches_early:
            early = backends_with("ends_batches_early")
            raise ConfigFieldError(
                "over_sample_rate",
                f"over_sample_rate={rate} with mode='sync' and name={self.name!r}: that engine's batch generation "
                f"cannot end early here; use name in {early}, or mode=async (agent loops), or leave it at 0",
            )
        streaming_tp = self.tensor_model_parallel_size > 1 and self.backend_spec.streams_requests
        if rate > 0.0 and self.mode == "async" and streaming_tp:
            raise ConfigFieldError(
                "over_sample_rate",
                f"over_sample_rate={rate} with name={self.name!r} and tensor_model_parallel_size="
                f"{self.tensor_model_parallel_size}: a tensor-parallel replica's continuous batching decodes what "
                "its first rank admitted in lock-step, so an abort could end only queued requests, not the slow ones "
                "being decoded; use tensor_model_parallel_size=1 or leave over_sample_rate at 0",
            )

    def _refuse_vllm_only_keys(self) -> None:
        """The vllm engine's own keys at another value than their default with another engine: refused, since
        that engine would ignore them (except the keys its spec says it reads: native's `enforce_eager`,
        `max_num_seqs`, `max_num_batched_tokens`)."""
        defaults = RolloutConfig(name="vllm")
        for key in _VLLM_ONLY_KEYS:
            if key in self.backend_spec.engine_keys:
                continue
            value = getattr(self, key)
            if value != getattr(defaults, key):
                readers = sorted(name for name in ROLLOUTS.names()
                                 if rollout_spec(name).reads_engine_keys or key in rollout_spec(name).engine_keys)
                raise ConfigFieldError(
                    key,
                    f"{key}={value!r} sets the vllm engine, but name={self.name!r} does not read it; use name in "
                    f"{readers} or leave it at its default",
                )

    def _check_engine_kwargs(self) -> None:
        """engine_kwargs: only the running engine's entry may be set, only vllm reads one, and not the arguments
        hybridflow's vllm wiring sets (`VLLM_RESERVED_KWARGS`)."""
        for engine, extra in self.engine_kwargs.items():
            if not extra:
                continue
            if engine != self.name or engine != "vllm":
                reason = (f"name={self.name!r} does not read them" if engine != self.name
                          else f"the {engine} engine takes no extra arguments")
                raise ConfigFieldError(
                    "engine_kwargs",
                    f"engine_kwargs.{engine}={dict(extra)} sets the {engine} engine, but {reason}; leave "
                    f"engine_kwargs.{engine} empty",
                )
            owned = sorted(set(extra) & set(VLLM_RESERVED_KWARGS))
            if owned:
                raise ConfigFieldError(
                    "engine_kwargs",
                    f"engine_kwargs.vllm sets {owned}, which hybridflow sets itself to drive vLLM (weights, log-probs, "
                    "placement); use the rollout keys for what they control (e.g. max_num_seqs, dtype), or drop them",
                )

    def _check_vllm_engine(self) -> None:
        """The vllm engine's keys against each other (the checks vLLM itself would make minutes later)."""
        check_positive("max_model_len", self.max_model_len, allow_none=True)
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        longest = self.prompt_length + self.response_length
        if self.max_model_len is not None and self.max_model_len < longest:
            raise ConfigFieldError(
                "max_model_len",
                f"max_model_len={self.max_model_len} is below prompt_length + response_length = {longest}: vLLM "
                f"would refuse the longest prompts; set max_model_len >= {longest} or null",
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.vllm_max_model_len:
            raise ConfigFieldError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens={self.max_num_batched_tokens} with enable_chunked_prefill=False is below "
                f"max_model_len={self.vllm_max_model_len}: a whole prompt must fit in one step; raise "
                "max_num_batched_tokens or set enable_chunked_prefill=True",
            )

    @property
    def vllm_max_model_len(self) -> int:
        """The vllm engine's max_model_len: the key, or prompt_length + response_length."""
        return self.max_model_len or self.prompt_length + self.response_length

    @property
    def log_prob_token_budget(self) -> int | None:
        """Tokens per old-log-prob micro-batch, or None to cut by rows."""
        return self.log_prob_max_token_len_per_gpu if self.log_prob_use_dynamic_bsz else None
