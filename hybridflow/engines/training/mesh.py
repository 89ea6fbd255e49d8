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

__all__ = ["ParallelLayout", "TrainingMeshes", "build_training_meshes"]


@dataclass(frozen=True)
class ParallelLayout:
    """How `world_size` ranks split into data (`dp`), tensor (`tp`) and sequence (`sp`) parallel groups."""

    world_size: int
    tp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.sp < 1:
            raise ValueError(f"tensor and sequence parallel sizes must be >= 1, got tp={self.tp} sp={self.sp}")
        if self.tp > 1 and self.sp > 1:
            raise ValueError(
                f"tensor_parallel_size={self.tp} with ulysses_sequence_parallel_size={self.sp}: combining them is "
                "not implemented; use one of the two"
            )
        if self.world_size % (self.tp * self.sp):
            raise ValueError(
                f"{self.world_size} ranks cannot form groups of tensor_parallel_size x ulysses_sequence_parallel_size "
                f"= {self.tp * self.sp}; the number of ranks must be a multiple of it"
            )

    @property
    def group_size(self) -> int:
        """Ranks that share one data shard (tp x sp)."""
        return self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel groups: distinct data shards per step."""
        return self.world_size // self.group_size

    def dp_rank(self, rank: int) -> int:
        """The data shard rank `rank` takes."""
        return rank // self.group_size

    def is_collect(self, rank: int) -> bool:
        """Whether rank `rank`'s output is kept (one per data-parallel group)."""
        return rank % self.group_size == 0


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
