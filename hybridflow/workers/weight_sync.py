"""Weight sync of split placement, worker side: the trainer pool's rank 0 broadcasts the actor's weights to every
rank of the rollout pool over a process group that spans both pools.

Each pool keeps its own default process group (FSDP on the trainer pool); the sync group is a second, standalone
group (`new_standalone_process_group`: gloo on CPU, nccl on GPUs) with its own TCP store, hosted by trainer rank 0:

    sync rank 0            = trainer rank 0 (sender)
    sync ranks 1..R        = rollout ranks 0..R-1 (receivers)

Tensors travel in the order the actor engine's `named_full_params()` yields them (full tensors, gathered one at a
time from the FSDP shards on every trainer rank), packed into byte buckets of about
`rollout.checkpoint_engine.update_weights_bucket_megabytes` (verl's key): one broadcast per bucket, not per tensor
(`plan_buckets`, computed alike on both sides from the weight info; a tensor larger than a bucket goes alone).
Nobody ever holds more than one bucket and one tensor of the state dict.
The first message of a sync is the policy version (the number of optimizer schedule steps), which the rollout
seeds its sampling with, as a colocated rollout does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.utils.device import new_standalone_process_group

WeightInfo = list[tuple[str, tuple[int, ...], str]]
"""`(hf_name, shape, dtype name)` of each tensor of a sync, in sending order."""

BUCKET_ALIGNMENT = 16
"""Bytes each tensor's offset in a bucket is rounded up to (a view of any dtype starts aligned)."""

SYNC_TIMEOUT = timedelta(minutes=30)
"""How long a member waits at one collective (a dead peer fails the sync after this)."""


def describe_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightInfo:
    """The `WeightInfo` of `named_tensors` (consumes them one at a time)."""
    return [_describe(name, tensor) for name, tensor in named_tensors]


def _describe(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    return name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def digest_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes: equal digests mean bitwise-equal tensors."""
    digests = {}
    for name, tensor in named_tensors:
        data = tensor.detach().to("cpu").contiguous()
        hasher = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
        hasher.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        digests[name] = hasher.hexdigest()
    return digests


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of `shape` and dtype name `dtype`."""
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def plan_buckets(info: WeightInfo, bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The buckets of a sync: per bucket, `(index into info, byte offset)` of each tensor, in order. A tensor
    joins the open bucket if it still fits (offsets aligned to BUCKET_ALIGNMENT), else opens the next one; a
    tensor larger than `bucket_bytes` fills a bucket alone. Pure: sender and receivers plan the same buckets."""
    buckets: list[list[tuple[int, int]]] = []
    used = bucket_bytes  # no open bucket yet
    for index, (_, shape, dtype) in enumerate(info):
        size = tensor_bytes(shape, dtype)
        offset = -(-used // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
        if not buckets or offset + size > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset))
        used = offset + size
    return buckets


def bucket_size(info: WeightInfo, bucket: list[tuple[int, int]]) -> int:
    """Bytes of a planned bucket (up to the end of its last tensor)."""
    index, offset = bucket[-1]
    return offset + tensor_bytes(info[index][1], info[index][2])


class WeightSyncGroup:
    """One member of the sync group; rank 0 hosts the rendezvous store at `address:port`."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, device: torch.device,
                 bucket_bytes: int) -> None:
        if world_size < 2:
            raise ValueError(f"a weight sync group needs a sender and at least one receiver, got world_size={world_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"weight sync buckets need a positive size, got {bucket_bytes} bytes")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.bucket_bytes = bucket_bytes
        self.num_broadcasts = 0
        """Weight broadcasts of the last sync (its buckets)."""
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

    def send(self, version: int, info: WeightInfo, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Sender: the policy version, then the tensors (described by `info`, in its order) bucket by bucket;
        returns the bytes sent."""
        self.broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        tensors = iter(named_tensors)
        num_bytes, self.num_broadcasts = 0, 0
        for bucket in plan_buckets(info, self.bucket_bytes):
            buffer = torch.empty(bucket_size(info, bucket), dtype=torch.uint8, device=self.device)
            for index, offset in bucket:
                name, tensor = next(tensors)
                expected = info[index]
                if _describe(name, tensor) != expected:
                    raise RuntimeError(f"weight sync: tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} does not "
                                       f"match the receivers' weight info {expected}")
                data = tensor.detach().contiguous().view(-1).view(torch.uint8)
                buffer[offset:offset + data.numel()].copy_(data)
                num_bytes += data.numel()
            self.broadcast(buffer)
            self.num_broadcasts += 1
        return num_bytes

    def receive_version(self) -> int:
        """Receiver: the policy version that opens a sync."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(version)
        return int(version.item())

    def receive(self, info: WeightInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: each tensor of `info` as its bucket arrives (views of a fresh bucket buffer; the consumer copies
        them before asking for the next bucket's)."""
        self.num_broadcasts = 0
        for bucket in plan_buckets(info, self.bucket_bytes):
            buffer = torch.empty(bucket_size(info, bucket), dtype=torch.uint8, device=self.device)
            self.broadcast(buffer)
            self.num_broadcasts += 1
            for index, offset in bucket:
                name, shape, dtype = info[index]
                size = tensor_bytes(shape, dtype)
                yield name, buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape)
