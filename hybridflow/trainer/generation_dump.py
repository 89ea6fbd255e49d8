"""Generations written to disk as verl's `trainer.rollout_data_dir` and `trainer.validation_data_dir` write them: one
JSON line per sample in `<dir>/<step>.jsonl` with `input`, `output`, `gts`, `score` and `step`, and beside them the
per-sample reward details of validation and, for training, each sample's prompt group (`uid`) and mean advantage.

A file is never overwritten: a step written again (a resumed run repeating it) goes to `<step>.<k>.jsonl`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.protocol import DataProto

__all__ = ["dump_generations", "generation_rows"]


def generation_rows(batch: DataProto, tokenizer: Any, scores: Sequence[float]) -> dict[str, list[Any]]:
    """The columns of a generated batch: decoded prompts and responses (special tokens dropped), ground truths,
    `scores`; `uid` and the mean advantage over each response's tokens where the batch has them."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"].bool()
    prompts = batch.batch["prompts"] if "prompts" in batch.batch.keys() else batch.batch["input_ids"][:, : -responses.shape[1]]
    columns: dict[str, list[Any]] = {
        "input": tokenizer.batch_decode(prompts, skip_special_tokens=True),
        "output": [tokenizer.decode(row[keep], skip_special_tokens=True) for row, keep in zip(responses, mask)],
        "gts": [_ground_truth(item) for item in batch.non_tensor_batch.get("reward_model", [None] * len(batch))],
        "score": [float(score) for score in scores],
    }
    if "uid" in batch.non_tensor_batch:
        columns["uid"] = [str(uid) for uid in batch.non_tensor_batch["uid"]]
    if "advantages" in batch.batch.keys():
        advantages = (batch.batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        columns["advantage"] = advantages.tolist()
    return columns


def dump_generations(directory: str | Path, step: int, columns: Mapping[str, Sequence[Any]]) -> Path:
    """Write one JSON line per sample (each column's i-th value, plus `step`) to `directory/<step>.jsonl`, or to
    `<step>.<k>.jsonl` if that exists; returns the path. Columns of another length than `input` are left out."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    size = len(columns["input"])
    kept = {key: list(values) for key, values in columns.items() if len(values) == size}
    path, k = directory / f"{step}.jsonl", 0
    while path.exists():
        k += 1
        path = directory / f"{step}.{k}.jsonl"
    lines = [json.dumps({**{key: _plain(values[i]) for key, values in kept.items()}, "step": step}, ensure_ascii=False)
             for i in range(size)]
    with open(path, "x", encoding="utf-8") as handle:  # "x": never write over a file
        handle.write("\n".join(lines) + "\n")
    return path


def _ground_truth(reward_model: Any) -> Any:
    return reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None


def _plain(value: Any) -> Any:
    """JSON-ready: numpy scalars and arrays as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
