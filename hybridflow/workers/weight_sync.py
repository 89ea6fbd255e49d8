"""Weight sync of split placement, worker side: the trainer pool's rank 0 broadcasts the actor's weights to every
rank of the rollout pool over a process group that spans both pools.

Each pool keeps its own default process group (FSDP on the trainer pool); the sync group is a second, standalone
group (`new_standalone_process_group`: gloo on CPU, nccl on GPUs) with its own TCP store, hosted by trainer rank 0:

    sync rank 0            = trainer rank 0 (sender)
    sync ranks 1..R        = rollout ranks 0..R-1 (receivers)

Tensors travel one at a time, in the order the actor engine's `named_full_params()` yields them (full tensors,
gathered one at a time from the FSDP shards on every trainer rank); nobody ever holds the whole state dict.
The first message of a sync is the policy version (the number of optimizer schedule steps), which the rollout
seeds its sampling with, as a colocated rollout does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.utils.device import new_standalone_process_group

WeightInfo = list[tuple[str, tuple[int, ...], str]]
"""`(hf_name, shape, dtype name)` of each tensor of a sync, in sending order."""

SYNC_TIMEOUT = timedelta(minutes=30)
"""How long a member waits at one collective (a dead peer fails the sync after this)."""


def describe_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightInfo:
    """The `WeightInfo` of `named_tensors` (consumes them one at a time)."""
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named_tensors]


def digest_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes: equal digests mean bitwise-equal tensors."""
    digests = {}
    for name, tensor in named_tensors:
        data = tensor.detach().to("cpu").contiguous()
        hasher = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
        hasher.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        digests[name] = hasher.hexdigest()
    return digests


class WeightSyncGroup:
    """One member of the sync group; rank 0 hosts the rendezvous store at `address:port`."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
        if world_size < 2:
            raise ValueError(f"a weight sync group needs a sender and at least one receiver, got world_size={world_size}")
        self.rank, self.world_size, self.device = rank, world_size, device
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=SYNC_TIMEOUT)
        self._store = store  # keep the server (rank 0) alive as long as the group
        self.group = new_standalone_process_group(
            dist.PrefixStore("hybridflow_weight_sync", store), rank, world_size, SYNC_TIMEOUT
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every member's `tensor` (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Sender: the policy version, then each tensor; returns the bytes sent."""
        self.broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        num_bytes = 0
        for _, tensor in named_tensors:
            self.broadcast(tensor.to(self.device).contiguous())
            num_bytes += tensor.numel() * tensor.element_size()
        return num_bytes

    def receive_version(self) -> int:
        """Receiver: the policy version that opens a sync."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(version)
        return int(version.item())

    def receive(self, info: WeightInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: each tensor of `info` as it arrives (a fresh buffer each; the consumer copies it)."""
        for name, shape, dtype in info:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.broadcast(tensor)
            yield name, tensor
