"""Checks of `hybridflow generate`'s config before Ray starts: the prompts file and its column, an output path
that holds nothing yet, the model, and rollout settings that batch generation honours. Keys that generation never
reads (LoRA, training-only model keys, evaluation sampling, log-probs, agent loops, profiling, trainer-only rollout
keys) are refused off their defaults (`IGNORED_BY_GENERATION`)."""

from __future__ import annotations

from typing import Any

from hybridflow.data.config import expand_path
from hybridflow.trainer.config.generation_schema import GenerationConfig
from hybridflow.trainer.config.model_checks import check_model_location, model_context_length
from hybridflow.trainer.config.parallel_checks import check_rollout_tensor_parallel
from hybridflow.utils.config import changed_leaves

__all__ = ["IGNORED_BY_GENERATION", "check_ignored_keys", "read_chats", "validate_generation_config"]

_PLAIN_WEIGHTS = (
    "generation loads the plain weights of model.path and applies no LoRA adapter: merge the adapter into them "
    "first (a hybridflow checkpoint: `hybridflow merge --local_dir <global_step_N> --target_dir <dir>`; a peft "
    "adapter: `PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(<dir>)`) and set "
    "model.path=<dir>"
)
_NO_TRAINING_ENGINE = "generation builds no training engine"
_SAMPLING = "generation samples with rollout.temperature/top_p/top_k/do_sample; set those"
_NO_LOG_PROBS = "generation computes no log-probs"
_NO_AGENT_LOOPS = "generation runs batch generation, no agent loops or tools"
_NO_PROFILING = "hybridflow generate does not profile"
_TRAIN_ONLY = "`hybridflow train` only"

IGNORED_BY_GENERATION: dict[str, str] = {
    "model.lora_adapter_path": _PLAIN_WEIGHTS,
    "model.lora_rank": _PLAIN_WEIGHTS,
    "model.lora_alpha": _NO_TRAINING_ENGINE,
    "model.target_modules": _NO_TRAINING_ENGINE,
    "model.target_parameters": _NO_TRAINING_ENGINE,
    "model.exclude_modules": _NO_TRAINING_ENGINE,
    "model.enable_gradient_checkpointing": _NO_TRAINING_ENGINE,
    "model.enable_activation_offload": _NO_TRAINING_ENGINE,
    "model.use_remove_padding": _NO_TRAINING_ENGINE,
    "model.use_fused_kernels": _NO_TRAINING_ENGINE,
    "model.fused_kernel_options": _NO_TRAINING_ENGINE,
    "rollout.val_kwargs": _SAMPLING,
    "rollout.log_prob_micro_batch_size": _NO_LOG_PROBS,
    "rollout.log_prob_micro_batch_size_per_gpu": _NO_LOG_PROBS,
    "rollout.log_prob_use_dynamic_bsz": _NO_LOG_PROBS,
    "rollout.log_prob_max_token_len_per_gpu": _NO_LOG_PROBS,
    "rollout.calculate_log_probs": "generation writes no log-probs (only the responses)",
    "rollout.agent": _NO_AGENT_LOOPS,
    "rollout.multi_turn": _NO_AGENT_LOOPS,  # its `enable` is refused first, with the rollout.mode check
    "rollout.profiler": _NO_PROFILING,
    "rollout.skip_rollout": _TRAIN_ONLY,
    "rollout.skip_dump_dir": _TRAIN_ONLY,
    "rollout.enable_rollout_routing_replay": _TRAIN_ONLY,
}
"""Keys (or whole sections) of the generation config that `hybridflow generate` never reads -> why; each is refused
when set off its default (verl's generation lines may pass them at their defaults)."""


def validate_generation_config(cfg: GenerationConfig) -> list[tuple[str, int]]:
    """Raises ValueError naming the key; returns the table of the job's arithmetic."""
    data, rollout, ranks = cfg.data, cfg.rollout, cfg.trainer.world_size
    if data.path is None or data.output_path is None:
        missing = "data.path" if data.path is None else "data.output_path"
        raise ValueError(f"{missing} is required: give the prompts' parquet file and the file to write")
    if not expand_path(data.path).is_file():
        raise ValueError(f"data.path={data.path!r} does not exist")
    if expand_path(data.output_path).exists():
        raise ValueError(f"data.output_path={data.output_path!r} exists; generation never writes over a file: "
                         "choose another path or move it")
    rows = len(read_chats(data.path, data.prompt_key))  # every row's messages, before any worker starts
    if rollout.n != 1:
        raise ValueError(f"rollout.n={rollout.n}: each generation call samples one response per prompt; set "
                         "data.n_samples for several (verl's main_generation does the same)")
    if rollout.mode != "sync" or rollout.multi_turn.enable:
        raise ValueError("generation calls the rollout's batch generation: set rollout.mode=sync and leave "
                         "rollout.multi_turn.enable off (agent loops run in `hybridflow train`)")
    check_ignored_keys(cfg)
    if (rollout.temperature == 0 or not rollout.do_sample) and data.n_samples > 1:
        raise ValueError(f"data.n_samples={data.n_samples} with greedy decoding (rollout.temperature="
                         f"{rollout.temperature}, do_sample={rollout.do_sample}) gives the same response each time; "
                         "set data.n_samples=1 or sample")
    cfg.ray_kwargs.check_output_files()
    check_model_location("model.path", cfg.model.path)
    check_model_location("model.tokenizer_path", cfg.model.tokenizer_path, weights=False)
    check_rollout_tensor_parallel(rollout, cfg.model, cfg.trainer, cfg.ray_kwargs.ray_init.address, "", "the workers")
    tp = rollout.tensor_model_parallel_size
    context = model_context_length(cfg.model.path, cfg.model.hf_config_overrides)
    if context is not None and rollout.prompt_length + rollout.response_length > context:
        raise ValueError(f"rollout.prompt_length + rollout.response_length = "
                         f"{rollout.prompt_length + rollout.response_length} exceeds the model's context of {context} "
                         f"tokens ({cfg.model.path}); lower them")
    return [
        ("prompts (rows of data.path)", rows),
        ("responses per prompt (data.n_samples)", data.n_samples),
        ("prompts per call (data.batch_size)", data.batch_size),
        ("generation calls", -(-rows // data.batch_size) * data.n_samples),
        ("ranks (nnodes x n_gpus_per_node)", ranks),
        ("replicas (ranks / tensor_model_parallel_size)", ranks // tp),
    ]


def check_ignored_keys(cfg: GenerationConfig) -> None:
    """Raises ValueError naming every key of `IGNORED_BY_GENERATION` (a leaf of a listed section) set off its
    default, with the value, the reason and the default to go back to."""
    defaults = GenerationConfig()
    refused = [f"{key}={value!r}: {reason}; leave it at its default ({default!r})"
               for path, reason in IGNORED_BY_GENERATION.items()
               for key, value, default in changed_leaves(path, _value_at(cfg, path), _value_at(defaults, path))]
    if refused:
        raise ValueError(" | ".join(refused))


def _value_at(cfg: Any, path: str) -> Any:
    """The value of the dotted key `path` in the typed config `cfg`."""
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def read_chats(path: str, key: str) -> list[list[dict[str, Any]]]:
    """Each row's chat messages from column `key` of the parquet file `path` (read alone, with pyarrow); a
    ValueError names a missing column or a row that is not a list of {role, content} messages."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(expand_path(path))
    if key not in parquet.schema_arrow.names:
        raise ValueError(f"data.prompt_key={key!r} is not a column of {path}; columns: {parquet.schema_arrow.names}")
    chats = []
    for index, value in enumerate(parquet.read(columns=[key]).column(key).to_pylist()):
        if not isinstance(value, list) or not value or not all(  # parquet fills a missing key with None
                isinstance(message, dict) and isinstance(message.get("role"), str) and message.get("content") is not None
                for message in value):
            raise ValueError(f"{path} row {index}: column {key!r} must hold chat messages (a list of "
                             f"{{role, content}}), got {str(value)[:120]!r}")
        chats.append([{k: v for k, v in message.items() if v is not None} for message in value])  # parquet's fill
    return chats
