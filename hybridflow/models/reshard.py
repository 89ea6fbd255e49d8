"""Moving weights between tensor-parallel layouts, one tensor at a time: a rank's shard of a full tensor, and a
full tensor reassembled from the shards of a group.

The layout is the model family's plan (`parallel_plan.param_shard_dim`): a split tensor is cut into `size` equal
contiguous blocks along its split dim and rank `r` holds block `r` (what DTensor's `Shard(dim)` holds on an evenly
divisible dim), every other tensor is held whole by every rank. So the training engine's DTensors (any mesh whose
tp dim uses the same plan) and the rollout's shards agree, and a hand-over between two layouts is: gather each
parameter to its full tensor on the source layout (`DTensor.full_tensor()`, collective), keep this rank's block on
the target layout (`shard_of`, a view), drop the full tensor before the next one. No rank ever holds a full state
dict, only one full tensor at a time.

A key/value projection of a group with more ranks than key/value heads (`kv_replicas` > 1) is cut into
`size / kv_replicas` blocks, one head each, and rank `r` holds block `r // kv_replicas`: the head its query heads
attend with (Megatron's and vLLM's replication).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from hybridflow.models.parallel_plan import Style, param_shard_dim

__all__ = [
    "full_from_shard", "named_full_from_shards", "named_shards", "param_blocks", "shard_of", "shard_shape",
]

KV_PROJECTIONS = ("k_proj", "v_proj")
"""Modules whose output features are key/value heads (replicated when a group has more ranks than heads)."""


def shard_shape(full_shape: torch.Size | tuple[int, ...], dim: int | None, size: int) -> tuple[int, ...]:
    """The shape of one rank's block of a tensor of `full_shape` split `size` ways along `dim` (None: whole)."""
    shape = tuple(full_shape)
    if dim is None or size == 1:
        return shape
    if shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {shape} does not split evenly into {size} shards")
    return (*shape[:dim], shape[dim] // size, *shape[dim + 1 :])


def shard_of(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s block of `full` split `size` ways along `dim` (None: `full` itself); a view, no copy.

    full: (..., n, ...) with n = full.shape[dim] divisible by size -> (..., n // size, ...).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for {size} shards")
    if dim is None or size == 1:
        return full
    length = shard_shape(full.shape, dim, size)[dim]
    return full.narrow(dim, rank * length, length)


def param_blocks(
    name: str, plan: dict[str, Style], rank: int, size: int, kv_replicas: int = 1
) -> tuple[int | None, int, int]:
    """`(dim, block, blocks)`: parameter `name` is cut into `blocks` along `dim` (None: held whole) and `rank` of a
    `size`-rank group holds block `block`; a key/value projection's heads are replicated on `kv_replicas` ranks."""
    dim, parts = param_shard_dim(name, plan), name.split(".")
    if dim is not None and kv_replicas > 1 and len(parts) >= 2 and parts[-2] in KV_PROJECTIONS:
        return dim, rank // kv_replicas, size // kv_replicas
    return dim, rank, size


def named_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], plan: dict[str, Style], rank: int, size: int,
    kv_replicas: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's shard of each `(hf_name, full_tensor)`, as they come (lazily: one full tensor alive at a time
    when the source is lazy, e.g. `FSDPEngine.named_full_params()`)."""
    for name, tensor in named_tensors:
        dim, block, blocks = param_blocks(name, plan, rank, size, kv_replicas)
        yield name, shard_of(tensor, dim, block, blocks)


def full_from_shard(local: torch.Tensor, dim: int | None, mesh) -> torch.Tensor:
    """The full tensor whose `Shard(dim)` blocks over the 1-D `mesh` are each rank's `local` (collective over the
    mesh; every rank gets the full tensor). dim None: `local` is already whole and is returned as is.

    local: (..., n // size, ...) -> (..., n, ...), on `local`'s device.
    """
    if dim is None or mesh.size() == 1:
        return local
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local.contiguous(), mesh, [Shard(dim)], run_check=False).full_tensor()


def named_full_from_shards(
    named_locals: Iterable[tuple[str, torch.Tensor]], plan: dict[str, Style], mesh, kv_replicas: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` for each `(hf_name, local shard)` of a tensor-parallel group, one at a time
    (collective: every rank of `mesh` must iterate the same names in the same order). A replicated key/value
    head is gathered from every rank and kept once."""
    for name, local in named_locals:
        dim, _, blocks = param_blocks(name, plan, 0, mesh.size(), kv_replicas)
        full = full_from_shard(local, dim, mesh)
        if dim is not None and blocks < mesh.size():  # (size x block) -> the first of each run of replicas
            full = full.unflatten(dim, (blocks, kv_replicas, -1)).select(dim + 1, 0).flatten(dim, dim + 1)
        yield name, full
