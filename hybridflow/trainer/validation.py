"""Validation: generate on the validation prompts (greedy or `val_kwargs.n` samples), score, aggregate.

Logged as verl does: `val-core/{data_source}/acc/mean@N` (and best@k / maj@k when N > 1), others under `val-aux/`.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from typing import Any

import numpy as np

from hybridflow.algorithms import flatten_validation_metrics, process_validation_metrics
from hybridflow.protocol import DataProto
from hybridflow.trainer.worker_setup import PROMPT_KEYS, rollout_inputs

logger = logging.getLogger(__name__)



def run_validation(trainer: Any) -> dict[str, float]:
    """Validation metrics of the trainer's current policy over its whole validation set."""
    val = trainer.config.actor_rollout_ref.rollout.val_kwargs
    data_sources: list[str] = []
    uids: list[str] = []
    infos: dict[str, list[Any]] = defaultdict(list)
    examples: list[tuple[str, float]] = []
    for batch_dict in trainer.val_dataloader:
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(val.n, interleave=True)
        prompts = rollout_inputs(batch, trainer.config)
        prompts.meta_info = {"validate": True}
        output = trainer.generator.generate_sequences(prompts)
        output.meta_info.pop("metrics", None)
        batch.pop(batch_keys=list(PROMPT_KEYS))
        batch = batch.union(output)
        result = trainer.val_reward_fn(batch, return_dict=True)
        scores = result["reward_tensor"].sum(-1).tolist()
        infos["reward"].extend(scores)
        for key, values in result.get("reward_extra_info", {}).items():
            if len(values) == len(batch):
                infos[key].extend(values)
        data_sources.extend(batch.non_tensor_batch["data_source"].tolist())
        uids.extend(batch.non_tensor_batch["uid"].tolist())
        if len(examples) < trainer.config.trainer.log_val_generations:
            examples.extend(_decode_examples(trainer, batch, scores))
    for text, score in examples[: trainer.config.trainer.log_val_generations]:
        logger.info("validation sample (score %.2f): %s", score, text)
    infos = {key: values for key, values in infos.items() if len(values) == len(uids)}
    return flatten_validation_metrics(process_validation_metrics(data_sources, uids, infos))


def _decode_examples(trainer: Any, batch: DataProto, scores: list[float]) -> list[tuple[str, float]]:
    tokenizer = trainer.reward_fn.tokenizer
    texts = []
    for row in range(min(len(batch), trainer.config.trainer.log_val_generations)):
        mask = batch.batch["response_mask"][row].bool()
        texts.append((tokenizer.decode(batch.batch["responses"][row][mask]), scores[row]))
    return texts
