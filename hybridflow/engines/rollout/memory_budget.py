"""`rollout.gpu_memory_utilization` for the hf and native engines: the share of this device's memory (a GPU's, or
on CPU this process's share of the host's RAM, as vLLM's CPU backend reads the key) that the rollout's weights and
KV cache may take. The engines decode at most as many sequences at once as fit in it: hf in `generate` calls of
that many rows, native in that many cache slots. vLLM applies the key itself.

A GPU belongs to one rank; a host's RAM is shared by every rank the worker group runs on that node
(`LOCAL_WORLD_SIZE`), so on CPU each rank's device is RAM / local ranks. Without that split, two ranks of a 2-core
24 GB host each took 0.5 x 24 GB for their caches, and a multi-turn run crossed the host-memory guard's budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.env import dist_local_world_size
from hybridflow.utils.device import device_memory_bytes
from hybridflow.utils.flops import attention_head_dim, text_config

GIB = 1024**3


def format_bytes(num_bytes: float) -> str:
    """'512 B', '12.3 KiB', '1.50 MiB', '2.00 GiB'."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers on this rank (each storage counted once: tied weights are one;
    a sharded DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def kv_bytes_per_token_of(config, dtype: torch.dtype) -> int:
    """`kv_bytes_per_token` from an HF text model config (grouped-query heads and an explicit head_dim honoured)."""
    text = text_config(config)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return kv_bytes_per_token(text.num_hidden_layers, kv_heads, attention_head_dim(text), dtype)


@dataclass(frozen=True)
class MemoryBudget:
    """What the rollout may hold on its device: `utilization` x `device_bytes`, of which `weight_bytes` are taken."""

    utilization: float
    device_bytes: int
    weight_bytes: int

    def __post_init__(self) -> None:
        if self.free_bytes <= 0:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.utilization} gives the rollout "
                f"{format_bytes(self.utilization * self.device_bytes)} of this device's "
                f"{format_bytes(self.device_bytes)}, less than its weights ({format_bytes(self.weight_bytes)}); "
                "raise gpu_memory_utilization"
            )

    @property
    def free_bytes(self) -> int:
        """Bytes left for the KV cache (and per-sequence buffers) after the weights."""
        return int(self.utilization * self.device_bytes) - self.weight_bytes

    def max_sequences(self, bytes_per_sequence: int, needed: int = 1) -> int:
        """How many sequences of `bytes_per_sequence` fit; ValueError when fewer than `needed` (e.g. the n samples
        of one prompt, which share one prefill) do."""
        fits = self.free_bytes // max(bytes_per_sequence, 1)
        if fits < needed:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.utilization} leaves {format_bytes(self.free_bytes)} after the "
                f"rollout's weights: room for {fits} sequence(s) of {format_bytes(bytes_per_sequence)} each, "
                f"fewer than the {needed} decoded together; raise gpu_memory_utilization or shorten "
                "prompt_length / response_length"
            )
        return fits


def rank_device_bytes(device: torch.device) -> int:
    """The memory one rank's rollout takes its share of: a GPU's own; on the host, its RAM over the ranks the
    worker group runs on this node (`LOCAL_WORLD_SIZE`, 1 outside a worker group)."""
    if device.type == "cuda":
        return device_memory_bytes(device)
    return device_memory_bytes(device) // dist_local_world_size()


def rollout_memory_budget(module: nn.Module, device: torch.device, utilization: float | None) -> MemoryBudget | None:
    """The budget of a rollout holding `module` on `device`; None when `utilization` is None (no limit)."""
    if utilization is None:
        return None
    return MemoryBudget(utilization, rank_device_bytes(device), module_bytes(module))
