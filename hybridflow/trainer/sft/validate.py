"""Cross-component checks of the SFT config, run before Ray starts, and its batch arithmetic."""

from __future__ import annotations

from hybridflow.engines.training.config import ParallelLayout
from hybridflow.models.parallel_plan import check_ep_layout, check_sp_layout, check_tp_layout
from hybridflow.trainer.config.schema import SFTConfig
from hybridflow.trainer.config.data_checks import check_data_files
from hybridflow.trainer.config.model_checks import check_model_location, model_context_length
from hybridflow.trainer.config.parallel_checks import model_section_config
from hybridflow.trainer.config.validate import check_optimizer_section
from hybridflow.trainer.config.verl_copies import forward_only_error


def validate_sft_config(cfg: SFTConfig) -> list[tuple[str, int]]:
    """Files, paths, batch arithmetic, the model's context and loggers; returns the batch table rows."""
    data, ranks = cfg.data, cfg.trainer.world_size
    if data.pad_mode == "no_padding" and not cfg.model.use_remove_padding:
        raise ValueError("data.pad_mode=no_padding computes on no padding: it needs model.use_remove_padding=True "
                         "(the packed forward); set it, or data.pad_mode=right")
    forward_only = forward_only_error("model.fsdp_config.forward_only", cfg.model.fsdp_config.forward_only, True)
    if forward_only is not None:
        raise ValueError(forward_only)
    check_data_files(data)
    check_sft_rows(data)
    check_optimizer_section(cfg.optim, "")
    layout = check_sft_parallelism(cfg)
    world = layout.dp
    where = "trainer.nnodes x trainer.n_gpus_per_node" + (
        f" / {layout.group_size} tensor/sequence-parallel peers" if layout.group_size > 1 else ""
    )
    if data.train_batch_size % world:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} cannot be split over {world} "
            f"{'data-parallel ' if layout.group_size > 1 else ''}ranks "
            f"({where}); make it a multiple of {world}"
        )
    per_rank = data.train_batch_size // world
    if data.token_budget is None and per_rank % data.micro_batch_size_per_gpu:
        raise ValueError(
            f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} does not divide the {per_rank} samples "
            f"per rank (data.train_batch_size={data.train_batch_size} / {world} ranks); use a divisor of {per_rank}"
        )
    check_model_location("model.path", cfg.model.path)
    check_model_location("model.tokenizer_path", cfg.model.tokenizer_path, weights=False)
    cfg.trainer.check_paths()
    check_sft_resume(cfg)
    context = model_context_length(cfg.model.path, cfg.model.hf_config_overrides)
    if context is not None and data.max_length > context:
        raise ValueError(
            f"data.max_length={data.max_length} exceeds the model's context of {context} tokens ({cfg.model.path}); "
            "lower it"
        )
    cfg.trainer.check_environment(cfg.ray_kwargs.ray_init.address)
    cfg.ray_kwargs.check_output_files()
    rows = [
        ("ranks (nnodes x n_gpus_per_node)", ranks),
        ("data-parallel groups (ranks / tp x sp)", world),
        ("samples per step (data.train_batch_size)", data.train_batch_size),
        ("samples per rank", per_rank),
    ]
    if data.token_budget is not None:
        return rows + [("tokens per micro-batch (max_token_len_per_gpu)", data.token_budget)]
    return rows + [
        ("micro-batch per rank (micro_batch_size_per_gpu)", data.micro_batch_size_per_gpu),
        ("gradient accumulation steps", per_rank // data.micro_batch_size_per_gpu),
    ]


def check_sft_parallelism(cfg: SFTConfig) -> ParallelLayout:
    """The tensor / sequence parallel layout: sizes that divide the ranks and the model, and the training engine's
    own rules (built by the same `SFTConfig.engine_config` the trainer uses)."""
    tp, sp = cfg.model.fsdp_config.tensor_parallel_size, cfg.ulysses_sequence_parallel_size
    ep, fsdp_size = cfg.model.fsdp_config.expert_parallel_size, cfg.model.fsdp_config.fsdp_size
    try:
        layout = ParallelLayout(cfg.trainer.world_size, tp, sp, ep, fsdp_size)
    except ValueError as err:
        raise ValueError(
            f"model.fsdp_config.tensor_parallel_size={tp}, ulysses_sequence_parallel_size={sp}, "
            f"model.fsdp_config.expert_parallel_size={ep}, model.fsdp_config.fsdp_size={fsdp_size}: {err}"
        ) from err
    try:
        cfg.engine_config(total_training_steps=1)  # the engine's own rules (packed rows for Ulysses, no LoRA with tp)
    except ValueError as err:
        raise ValueError(f"the SFT training engine: {err}") from err
    if layout.group_size > 1 or layout.ep > 1:
        model_config = model_section_config(cfg.model)
        check_tp_layout(model_config, tp, "model.fsdp_config.tensor_parallel_size")
        check_sp_layout(model_config, sp, "ulysses_sequence_parallel_size")
        check_ep_layout(model_config, ep, "model.fsdp_config.expert_parallel_size")
    return layout


MEDIA_COLUMNS = ("images", "videos")
"""verl's SFT datasets read images and videos from these columns (image_key / video_key defaults)."""


def sft_resumed_settings(cfg: SFTConfig) -> dict:
    """What an SFT resume restores rather than reads (see `resume_checks.resumed_settings`)."""
    return {"model.path": cfg.model.path, "optim.lr": cfg.optim.lr}


def check_sft_resume(cfg: SFTConfig) -> None:
    """A resume that would ignore a changed model path or learning rate is refused before Ray."""
    from hybridflow.trainer.checkpoint_dirs import resume_candidate
    from hybridflow.trainer.config.resume_checks import check_resumed_settings

    run = cfg.trainer
    path = resume_candidate(run.resume_mode, run.resume_from_path, run.local_dir().resolve())
    if path is not None:
        check_resumed_settings(path, sft_resumed_settings(cfg))


def check_sft_rows(data) -> None:
    """Every data file has the columns the samples are read from (data.prompt_key / response_key, or
    data.multiturn.messages_key), and carries no images or videos: SFT trains on text, and would drop them and train
    on their placeholders. Names the file and the column; reads only the media columns."""
    import pyarrow.parquet as pq  # here: a config error prints before pyarrow loads

    from hybridflow.data.config import expand_path
    from hybridflow.trainer.config.data_checks import holds_values

    needed = ({"data.multiturn.messages_key": data.multiturn.messages_key} if data.multiturn.enable else
              {"data.prompt_key": data.prompt_key, "data.response_key": data.response_key})
    for name, path in data.named_files():
        parquet = pq.ParquetFile(expand_path(path))
        if parquet.metadata.num_rows == 0:
            raise ValueError(f"{name} entry {path!r} holds no rows; give a file with samples")
        missing = {key: column for key, column in needed.items() if column not in parquet.schema_arrow.names}
        if missing:
            key, column = next(iter(missing.items()))
            raise ValueError(f"{name} entry {path!r} has no {column!r} column ({key}); columns: "
                             f"{parquet.schema_arrow.names}")
        media = next((column for column in MEDIA_COLUMNS if holds_values(parquet, column)), None)
        if media is not None:
            raise ValueError(
                f"{name} entry {path!r}: column {media!r} holds {media}, but hybridflow's SFT trains on "
                "text only (vision-language SFT is not supported yet): the rows would train without them; "
                "drop the column, or train the vision-language model with RL (hybridflow train)"
            )
