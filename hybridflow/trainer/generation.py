"""The generation stage shared by training steps and validation: repeat prompts, generate, join the outputs."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.trainer.scaffold import worker_metrics

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
"""The tensors a rollout reads; the trainer drops them from the batch and takes the rollout's versions."""
ROLLOUT_NON_TENSOR_KEYS = ("multi_modal_inputs",)
"""Per-row fields a rollout reads besides the tensors (a vision-language prompt's images)."""


def generate_batch(
    generator: Any, batch_dict: dict, n: int, *, pass_rows: bool, validate: bool, overrides: dict | None = None
) -> tuple[DataProto, dict[str, float]]:
    """`n` responses per prompt of `batch_dict` (each prompt's samples share a `uid`), joined to the prompt rows.

    `generator` is the actor/rollout worker group or the agent-loop manager; `pass_rows` sends every row field
    along (agent loops read them); `validate` selects the validation sampling; `overrides` change sampling
    parameters for this call (e.g. `{"do_sample": False}` for ReMax's greedy baseline). Returns the batch and the
    generator's metrics.
    """
    batch, prompts = build_prompts(batch_dict, n, pass_rows=pass_rows, validate=validate, overrides=overrides)
    return join_responses(batch, generator.generate_sequences(prompts))


def build_prompts(
    batch_dict: dict, n: int, *, pass_rows: bool, validate: bool, overrides: dict | None = None
) -> tuple[DataProto, DataProto]:
    """The rows repeated `n` times (one `uid` per prompt) and what the generator is sent (see `generate_batch`)."""
    batch = DataProto.from_single_dict(batch_dict)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    batch = batch.repeat(n, interleave=True)
    images = [key for key in ROLLOUT_NON_TENSOR_KEYS if key in batch.non_tensor_batch]
    prompts = batch.select(
        batch_keys=list(PROMPT_KEYS), non_tensor_batch_keys=None if pass_rows else images, meta_info_keys=[]
    )
    prompts.meta_info = {"validate": validate, **(overrides or {})}
    return batch, prompts


def join_responses(batch: DataProto, output: DataProto) -> tuple[DataProto, dict[str, float]]:
    """The rows of `build_prompts` joined with the generator's `output`; and the generator's metrics."""
    metrics = worker_metrics(output)
    batch.pop(batch_keys=list(PROMPT_KEYS))
    return batch.union(output), metrics
