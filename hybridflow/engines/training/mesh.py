"""The training engine's device meshes: data parallel (FSDP2) x tensor parallel, or x Ulysses sequence parallel.

Ranks are laid out data-parallel-major: the `tp` (or `sp`) ranks of one data-parallel group are consecutive, so
they sit on one node when nodes hold a multiple of them. Tensor/sequence-parallel peers take the same data;
`ParallelLayout` says which data shard a rank takes and whether its output is collected (the first of its group).
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
    """The meshes one engine uses: FSDP2 shards over `fsdp`; `tp` / `sp_group` exist when their size is > 1."""

    layout: ParallelLayout
    fsdp: DeviceMesh
    tp: DeviceMesh | None = None
    sp_group: dist.ProcessGroup | None = None


def build_training_meshes(device: torch.device, layout: ParallelLayout) -> TrainingMeshes:
    """Create the meshes (collective: every rank calls it with the same layout).

    FSDP2 shards over the data-parallel ranks with tensor parallelism (the (dp, tp) mesh's `dp` dimension), and
    over all ranks with sequence parallelism (sequence-parallel peers hold replicas of the same weights, so their
    gradients, which sum to the shard's, are averaged with everyone else's).
    """
    if layout.tp > 1:
        mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        return TrainingMeshes(layout, fsdp=mesh["dp"], tp=mesh["tp"])
    fsdp = init_device_mesh(device.type, (layout.world_size,), mesh_dim_names=("fsdp",))
    if layout.sp > 1:
        sp_mesh = init_device_mesh(device.type, (layout.dp, layout.sp), mesh_dim_names=("dp", "sp"))
        return TrainingMeshes(layout, fsdp=fsdp, sp_group=sp_mesh["sp"].get_group())
    return TrainingMeshes(layout, fsdp=fsdp)
