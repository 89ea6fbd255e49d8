"""Checks of `hybridflow generate`'s config before Ray starts: the prompts file and its column, an output path
that holds nothing yet, the model, and rollout settings that batch generation honours."""

from __future__ import annotations

from hybridflow.data.config import expand_path
from hybridflow.trainer.config.generation_schema import GenerationConfig
from hybridflow.trainer.config.model_checks import check_model_location, model_context_length
from hybridflow.trainer.config.parallel_checks import check_rollout_tensor_parallel

__all__ = ["validate_generation_config"]


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
    import pyarrow.parquet as pq

    columns = pq.ParquetFile(expand_path(data.path)).schema_arrow.names
    if data.prompt_key not in columns:
        raise ValueError(f"data.prompt_key={data.prompt_key!r} is not a column of {data.path}; columns: {columns}")
    if rollout.n != 1:
        raise ValueError(f"rollout.n={rollout.n}: each generation call samples one response per prompt; set "
                         "data.n_samples for several (verl's main_generation does the same)")
    if rollout.mode != "sync" or rollout.multi_turn.enable:
        raise ValueError("generation calls the rollout's batch generation: set rollout.mode=sync and leave "
                         "rollout.multi_turn.enable off (agent loops run in `hybridflow train`)")
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
    rows = pq.ParquetFile(expand_path(data.path)).metadata.num_rows
    return [
        ("prompts (rows of data.path)", rows),
        ("responses per prompt (data.n_samples)", data.n_samples),
        ("prompts per call (data.batch_size)", data.batch_size),
        ("generation calls", -(-rows // data.batch_size) * data.n_samples),
        ("ranks (nnodes x n_gpus_per_node)", ranks),
        ("replicas (ranks / tensor_model_parallel_size)", ranks // tp),
    ]
