"""Cross-component checks of the SFT config, run before Ray starts, and its batch arithmetic."""

from __future__ import annotations

from hybridflow.trainer.config.schema import SFTConfig
from hybridflow.trainer.config.validate import (
    check_data_files,
    check_device,
    check_logger_packages,
    check_model_location,
    check_resume_path,
    check_run_dir,
    model_context_length,
)


def validate_sft_config(cfg: SFTConfig) -> list[tuple[str, int]]:
    """Files, paths, batch arithmetic, the model's context and loggers; returns the batch table rows."""
    data, world = cfg.data, cfg.trainer.world_size
    check_data_files(data)
    if data.train_batch_size % world:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} cannot be split over {world} ranks "
            f"(trainer.nnodes x trainer.n_gpus_per_node); make it a multiple of {world}"
        )
    per_rank = data.train_batch_size // world
    if per_rank % data.micro_batch_size_per_gpu:
        raise ValueError(
            f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} does not divide the {per_rank} samples "
            f"per rank (data.train_batch_size={data.train_batch_size} / {world} ranks); use a divisor of {per_rank}"
        )
    check_model_location("model.path", cfg.model.path)
    check_model_location("model.tokenizer_path", cfg.model.tokenizer_path, weights=False)
    check_resume_path(cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
    check_run_dir(cfg.trainer)
    context = model_context_length(cfg.model.path)
    if context is not None and data.max_length > context:
        raise ValueError(
            f"data.max_length={data.max_length} exceeds the model's context of {context} tokens ({cfg.model.path}); "
            "lower it"
        )
    check_logger_packages(cfg.trainer.logger)
    check_device(cfg.trainer, cfg.ray_kwargs.ray_init.address)
    return [
        ("ranks (nnodes x n_gpus_per_node)", world),
        ("samples per step (data.train_batch_size)", data.train_batch_size),
        ("samples per rank", per_rank),
        ("micro-batch per rank (micro_batch_size_per_gpu)", data.micro_batch_size_per_gpu),
        ("gradient accumulation steps", per_rank // data.micro_batch_size_per_gpu),
    ]


def format_batch_table(rows: list[tuple[str, int]]) -> str:
    """The rows of `validate_sft_config` as aligned text."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(["[sft]"] + [f"  {label:<{width}}  {value}" for label, value in rows])
