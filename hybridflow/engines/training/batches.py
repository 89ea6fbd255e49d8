"""Micro-batches of the training engine: reading, splitting, selecting and moving a batch's rows, putting results
back in row order, and reducing per-micro-batch metrics with one host transfer.

A batch is a `DataProto` (the worker boundary) or a mapping / TensorDict of (bs, ...) tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.seqlen_balancing import partition_by_tokens

__all__ = [
    "Batch", "INPUT_KEYS", "get", "in_row_order", "num_rows", "partition_units", "reduce_metrics", "response_width", "select_rows", "split",
    "to_device", "token_budget_units",
]

Batch = Any  # DataProto, or a Mapping / TensorDict of tensors
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def get(batch: Batch, key: str) -> torch.Tensor:
    """The tensor `key` of a batch."""
    return batch.batch[key] if isinstance(batch, DataProto) else batch[key]


def response_width(batch: Batch) -> int:
    """Columns of `responses` (0 for a batch without responses, e.g. a reward model's)."""
    keys = batch.batch.keys() if isinstance(batch, DataProto) else batch.keys()
    return get(batch, "responses").size(1) if "responses" in keys else 0


def num_rows(batch: Batch) -> int:
    return get(batch, "input_ids").size(0)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A shallow copy of `batch` on `device` (the caller's batch stays where it is); the copies do not block."""
    if isinstance(batch, DataProto):
        return DataProto(
            batch=batch.batch.to(device, non_blocking=True), non_tensor_batch=batch.non_tensor_batch,
            meta_info=batch.meta_info,
        )
    return {key: batch[key].to(device, non_blocking=True) for key in batch.keys()}


def split(batch: Batch, size: int) -> list[Batch]:
    """Consecutive micro-batches of `size` rows."""
    if isinstance(batch, DataProto):
        return batch.split(size)
    return [{key: batch[key][start : start + size] for key in batch.keys()} for start in range(0, num_rows(batch), size)]


def select_rows(batch: Batch, rows: list[int]) -> Batch:
    """The rows `rows` of a batch, in that order."""
    if isinstance(batch, DataProto):
        return batch.select_idxs(rows)
    index = torch.tensor(rows, dtype=torch.long)
    return {key: batch[key][index] for key in batch.keys()}


def in_row_order(values: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """`values` whose row i belongs to original row `order[i]`, put back in the original row order."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[torch.tensor(order, dtype=torch.long)] = values
    return restored


def token_budget_units(
    prompt_tokens: Sequence[int], response_tokens: Sequence[int], groups: Sequence[int] | None, max_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """The units that token-budget micro-batches are cut from, and what each costs a forward, in tokens.

    Without `groups` a unit is a row (prompt + response tokens). With `groups` (rows sharing a prompt: a group index
    per row) a unit is a prompt group, which a shared-prompt forward computes as one prompt plus its responses; a
    group over `max_tokens` is cut into consecutive runs of rows that fit, each sharing the prompt again.
    """
    if groups is None:
        return [[row] for row in range(len(prompt_tokens))], [p + r for p, r in zip(prompt_tokens, response_tokens)]
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(int(group), []).append(row)
    units, tokens = [], []
    for rows in members.values():
        prompt = prompt_tokens[rows[0]]
        unit, total = [], prompt
        for row in rows:
            if unit and total + response_tokens[row] > max_tokens:
                units.append(unit)
                tokens.append(total)
                unit, total = [], prompt
            unit.append(row)
            total += response_tokens[row]
        units.append(unit)
        tokens.append(total)
    return units, tokens


def partition_units(units: list[list[int]], tokens: list[int], count: int) -> list[list[int]]:
    """Rows of `units` in `count` micro-batches of near-equal tokens, each unit whole (`partition_by_tokens` over
    units). With fewer units than `count` (another rank needs more micro-batches), the largest units are halved
    first: their halves still share their prompt within each half."""
    units, tokens = list(units), list(tokens)
    while len(units) < count and max(len(unit) for unit in units) > 1:
        index = max(range(len(units)), key=lambda i: (len(units[i]), tokens[i]))
        unit, share = units.pop(index), tokens.pop(index)
        half = len(unit) // 2
        units += [unit[:half], unit[half:]]
        tokens += [share * half // len(unit), share - share * half // len(unit)]
    return [sorted(row for unit in part for row in units[unit]) for part in partition_by_tokens(tokens, count)]


def reduce_metrics(collected: Mapping[str, Sequence[float | torch.Tensor]]) -> dict[str, float]:
    """The mean of each metric's values (floats or 0-dim tensors, one per micro-batch). Tensor metrics are averaged
    on their device and reach the host in one transfer for all keys (one synchronisation per step)."""
    result: dict[str, float] = {}
    on_device: dict[str, torch.Tensor] = {}
    for key, values in collected.items():
        if values and all(isinstance(value, torch.Tensor) for value in values):
            on_device[key] = torch.stack([value.detach().float().reshape(()) for value in values]).mean()
        elif values:
            result[key] = sum(float(value) for value in values) / len(values)
    if on_device:
        devices = {value.device for value in on_device.values()}
        means = torch.stack([value.to(next(iter(devices))) for value in on_device.values()]).cpu().tolist()
        result.update(zip(on_device, means))
    return result
