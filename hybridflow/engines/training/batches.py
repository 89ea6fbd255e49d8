"""Micro-batches of the training engine: reading, splitting, selecting and moving a batch's rows, putting results
back in row order, and reducing per-micro-batch metrics with one host transfer.

The engine works on `DataProto`s (the worker boundary's type). A caller may hand it a mapping or TensorDict of
(bs, ...) tensors instead: `as_data_proto` wraps it once, at the engine's entry, so nothing below switches on type.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.seqlen_balancing import partition_by_tokens

__all__ = [
    "INPUT_KEYS", "as_data_proto", "get", "in_row_order", "num_rows", "partition_units", "reduce_metrics",
    "response_width", "select_rows", "split", "to_device", "token_budget_units",
]

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def as_data_proto(batch: Any) -> DataProto:
    """`batch` as a DataProto: itself, or a mapping / TensorDict of (bs, ...) tensors wrapped (no copy)."""
    if isinstance(batch, DataProto):
        return batch
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        return DataProto.from_dict(tensors={key: batch[key] for key in batch.keys()})
    raise TypeError(
        f"the training engine takes a DataProto or a mapping / TensorDict of (bs, ...) tensors, not "
        f"{type(batch).__name__}"
    )


def get(batch: DataProto, key: str) -> torch.Tensor:
    """The tensor `key` of a batch."""
    return batch.batch[key]


def response_width(batch: DataProto) -> int:
    """Columns of `responses` (0 for a batch without responses, e.g. a reward model's)."""
    return batch.batch["responses"].size(1) if "responses" in batch.batch.keys() else 0


def num_rows(batch: DataProto) -> int:
    return batch.batch["input_ids"].size(0)


def to_device(batch: DataProto, device: torch.device) -> DataProto:
    """A shallow copy of `batch` on `device` (the caller's batch stays where it is); the copies do not block."""
    return DataProto(
        batch=batch.batch.to(device, non_blocking=True), non_tensor_batch=batch.non_tensor_batch,
        meta_info=batch.meta_info,
    )


def split(batch: DataProto, size: int) -> list[DataProto]:
    """Consecutive micro-batches of `size` rows."""
    return batch.split(size)


def select_rows(batch: DataProto, rows: list[int]) -> DataProto:
    """The rows `rows` of a batch, in that order."""
    return batch.select_idxs(rows)


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


def reduce_metrics(collected: Mapping[str, Sequence[float | torch.Tensor]],
                   summed: Collection[str] = ()) -> dict[str, float]:
    """The mean of each metric's values (floats or 0-dim tensors, one per micro-batch), or the sum for the keys in
    `summed` (each micro-batch's share of a step-level quantity, such as a loss normalised by the step's global
    token count). Tensor metrics are reduced on their device and reach the host in one transfer for all keys (one
    synchronisation per step)."""
    result: dict[str, float] = {}
    on_device: dict[str, torch.Tensor] = {}
    for key, values in collected.items():
        if values and all(isinstance(value, torch.Tensor) for value in values):
            stacked = torch.stack([value.detach().float().reshape(()) for value in values])
            on_device[key] = stacked.sum() if key in summed else stacked.mean()
        elif values:
            result[key] = sum(float(value) for value in values) / (1 if key in summed else len(values))
    if on_device:
        devices = {value.device for value in on_device.values()}
        means = torch.stack([value.to(next(iter(devices))) for value in on_device.values()]).cpu().tolist()
        result.update(zip(on_device, means))
    return result
