"""Micro-batches of the training engine: reading, splitting, selecting and moving a batch's rows, putting results
back in row order, and reducing per-micro-batch metrics with one host transfer.

A batch is a `DataProto` (the worker boundary) or a mapping / TensorDict of (bs, ...) tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.protocol import DataProto

__all__ = ["Batch", "INPUT_KEYS", "get", "in_row_order", "num_rows", "reduce_metrics", "select_rows", "split", "to_device"]

Batch = Any  # DataProto, or a Mapping / TensorDict of tensors
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def get(batch: Batch, key: str) -> torch.Tensor:
    """The tensor `key` of a batch."""
    return batch.batch[key] if isinstance(batch, DataProto) else batch[key]


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
