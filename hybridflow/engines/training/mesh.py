"""The training engine's device meshes: data parallel (FSDP2) x tensor parallel, or x Ulysses sequence parallel,
and (MoE) x expert parallel, alone or with Ulysses.

Ranks are laid out data-parallel-major: the `tp` (or `sp`) ranks of one data-parallel group are consecutive, so
they sit on one node when nodes hold a multiple of them. Tensor/sequence-parallel peers take the same data;
`ParallelLayout` says which data shard a rank takes and whether its output is collected (the first of its group).
Expert-parallel peers take different data: the `ep` consecutive ranks of a group split the experts, and the
`efsdp` ranks holding the same experts shard them with FSDP2 (`expert_parallel.py`). With hybrid sharding
(`fsdp_size`), FSDP2's mesh is 2-D: groups of fsdp_size consecutive ranks shard, the groups replicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridflow.engines.training.config import ParallelLayout

__all__ = ["ParallelLayout", "TrainingMeshes", "build_training_meshes"]


@dataclass
class TrainingMeshes:
    """The meshes one engine uses: FSDP2 shards over `fsdp`; `tp` / `sp_group` exist when their size is > 1, and
    with expert parallelism `ep` (ranks splitting the experts), `efsdp` (ranks holding the same experts) and
    `ep_tp` (this rank alone: transformers' EP dispatch takes a tensor-parallel mesh)."""

    layout: ParallelLayout
    fsdp: DeviceMesh
    tp: DeviceMesh | None = None
    sp_group: dist.ProcessGroup | None = None
    ep: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None
    ep_tp: DeviceMesh | None = None


def build_training_meshes(device: torch.device, layout: ParallelLayout) -> TrainingMeshes:
    """Create the meshes (collective: every rank calls it with the same layout).

    FSDP2 shards over the data-parallel ranks with tensor parallelism (the (dp, tp) mesh's `dp` dimension), and
    over all ranks with sequence parallelism (sequence-parallel peers hold replicas of the same weights, so their
    gradients, which sum to the shard's, are averaged with everyone else's).
    """
    if layout.tp > 1:
        mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        return TrainingMeshes(layout, fsdp=mesh["dp"], tp=mesh["tp"])
    if layout.hybrid_shards:  # HSDP: a 2-D mesh, FSDP2 replicates over its first dim and shards over its second
        shape = (layout.world_size // layout.fsdp_size, layout.fsdp_size)
        fsdp = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    else:
        fsdp = init_device_mesh(device.type, (layout.world_size,), mesh_dim_names=("fsdp",))
    meshes = TrainingMeshes(layout, fsdp=fsdp)
    if layout.sp > 1:
        sp_mesh = init_device_mesh(device.type, (layout.dp, layout.sp), mesh_dim_names=("dp", "sp"))
        meshes.sp_group = sp_mesh["sp"].get_group()
    if layout.ep > 1:
        # With Ulysses the ep ranks may hold slices of the same rows: to the all-to-all they are different tokens.
        experts = init_device_mesh(
            device.type, (layout.world_size // layout.ep, layout.ep, 1), mesh_dim_names=("efsdp", "ep", "ep_tp")
        )
        meshes.ep, meshes.efsdp, meshes.ep_tp = experts["ep"], experts["efsdp"], experts["ep_tp"]
    return meshes
