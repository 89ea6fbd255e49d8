"""`hybridflow generate` (verl's `main_generation`): sample `data.n_samples` responses for every prompt of a parquet
file with the rollout engine on a group of rollout workers, and write the rows back with a `responses` column.

    hybridflow generate data.path=data/test.parquet data.output_path=out/gen.parquet data.n_samples=4 \
        model.path=smollm2-135m-instruct rollout.temperature=1.0 rollout.response_length=256

Each row's `data.prompt_key` column holds its chat messages; the tokenizer's chat template (with the generation
prompt) renders them. Prompts go to the workers `data.batch_size` at a time, padded to a multiple of the ranks;
each of the n samples is a separate call with its own sampling stream (`sampling_seed_offset`), so the samples
of one prompt differ. The output is written to a temporary file beside `data.output_path` and renamed when
complete: an interrupted run leaves no partial file, and an existing file is never written over (checked before
Ray starts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.config import expand_path
from hybridflow.data.new_parquet import write_new_parquet
from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer.config.generation_checks import read_chats
from hybridflow.trainer.config.generation_schema import GenerationConfig
from hybridflow.trainer.scaffold import WorkerProcesses, build_tokenizer, init_ray, worker_runtime, write_ray_timeline

__all__ = ["render_prompts", "run_generation"]

logger = logging.getLogger(__name__)


def render_prompts(tokenizer: Any, chats: list[list[dict[str, Any]]], cfg: GenerationConfig) -> list[list[int]]:
    """Each chat rendered by the chat template, with the generation prompt; a ValueError names the rows longer than
    rollout.prompt_length (verl would cut them, losing the generation prompt)."""
    ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         **cfg.data.apply_chat_template_kwargs) for chat in chats]
    ids = [list(row["input_ids"]) if isinstance(row, dict) or hasattr(row, "keys") else list(row) for row in ids]
    too_long = [index for index, row in enumerate(ids) if len(row) > cfg.rollout.prompt_length]
    if too_long:
        longest = max(len(ids[index]) for index in too_long)
        raise ValueError(f"{len(too_long)} prompts of {cfg.data.path} (rows {too_long[:5]}...) are longer than "
                         f"rollout.prompt_length={cfg.rollout.prompt_length} tokens (the longest: {longest}); raise it")
    return ids


def _batch(rows: list[list[int]], pad_id: int) -> DataProto:
    """Left-padded prompts with their attention mask and positions."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, width - len(row):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})


def _decode(tokenizer: Any, output: DataProto) -> list[str]:
    lengths = output.batch["response_mask"].sum(-1).tolist()
    return [tokenizer.decode(output.batch["responses"][row, :length].tolist(), skip_special_tokens=True)
            for row, length in enumerate(lengths)]


def run_generation(cfg: GenerationConfig) -> Path:
    """Generate and write `data.output_path` (see the module docstring); returns its path."""
    from hybridflow.workers import ActorRolloutRefWorker
    from hybridflow.workers.config import ActorRolloutRefConfig

    import pandas as pd

    frame = pd.read_parquet(expand_path(cfg.data.path))
    chats = read_chats(cfg.data.path, cfg.data.prompt_key)
    tokenizer = build_tokenizer(cfg.model, cfg.data.trust_remote_code)
    prompts = render_prompts(tokenizer, chats, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not cfg.trainer.local_mode:
        init_ray(cfg.ray_kwargs.ray_init, cfg.trainer.world_size)
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, ActorRolloutRefConfig(model=cfg.model, rollout=cfg.rollout),
                                  "rollout", worker_runtime(cfg.trainer, 1))
    processes = WorkerProcesses(cfg.trainer, worker, name_prefix="hybridflow_generate", roles=("rollout",))
    responses: list[list[str]] = [[] for _ in prompts]
    try:
        processes.group.init_model()
        size, samples = cfg.data.batch_size, cfg.data.n_samples
        for first in range(0, len(prompts), size):
            batch, pad = pad_dataproto_to_divisor(_batch(prompts[first:first + size], pad_id), processes.group.world_size)
            for sample in range(samples):
                batch.meta_info = {"sampling_seed_offset": (first // size) * samples + sample}
                texts = _decode(tokenizer, unpad_dataproto(processes.group.generate_sequences(batch), pad))
                for offset, text in enumerate(texts):
                    responses[first + offset].append(text)
            logger.info("generated %d of %d prompts x %d samples", min(first + size, len(prompts)), len(prompts),
                        samples)
    finally:
        write_ray_timeline(cfg.ray_kwargs.timeline_json_file)
        processes.shutdown()
    return _write(frame, responses, cfg.data.output_path)


def _write(frame: Any, responses: list[list[str]], output_path: str) -> Path:
    """The rows with their responses, written to a temporary file and renamed into place (never over a file)."""
    frame["responses"] = responses
    target = write_new_parquet(frame, output_path, "data.output_path")
    logger.info("wrote %d rows with %d responses each to %s", len(frame), len(responses[0]) if responses else 0,
                target)
    return target
